"""Recovery: the pass every worker runs periodically (one at a time, by advisory lock).

Redis may lose messages and workers may die; Postgres still knows everything. Each pass:
1. marks workers whose heartbeat stopped as dead;
2. releases the items of dead workers (as crash suspects) and items whose lease lapsed;
3. expires jobs past their completion window;
4. finalizes jobs whose items are all terminal, and makes the output files of finished
   batches that have none yet (their finisher makes them at once; this catches the rest);
5. re-enqueues live jobs with pending items and no sign of life (a lost or never-sent hint).
Each step runs in its own short transaction, so a pass never holds locks for long.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.db import reads
from thinkbatch.jobs.fleet import live_workers
from thinkbatch.openai import batches
from thinkbatch.settings import Settings

log = logging.getLogger(__name__)

# pg_try_advisory_lock key: "tbsweep" as an integer, shared by every process of a deployment.
SWEEP_LOCK_KEY = 0x7462_7377_6565_70


EXPIRED_FILES_PER_SWEEP = 100


@dataclass
class SweepReport:
    ran: bool = False
    dead_workers: list[str] = field(default_factory=list)
    released: int = 0
    expired_jobs: int = 0
    finalized: int = 0
    republished: list[uuid.UUID] = field(default_factory=list)
    files_expired: int = 0
    batch_files: int = 0


def sweep(
    engine: sa.Engine,
    settings: Settings,
    publish: Callable[[uuid.UUID], bool],
    *,
    judge_workers: bool = True,
) -> SweepReport:
    """One recovery pass. `judge_workers=False` skips declaring workers dead: right after a
    database outage every heartbeat looks stale, and live workers need a moment to beat."""
    report = SweepReport()
    with engine.connect() as lock_conn:
        got = lock_conn.execute(
            sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": SWEEP_LOCK_KEY}
        ).scalar()
        lock_conn.commit()
        if not got:
            return report
        try:
            report.ran = True
            if judge_workers:
                _release_dead(engine, settings, report)
            _sweep(engine, settings, publish, report)
        finally:
            lock_conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": SWEEP_LOCK_KEY})
            lock_conn.commit()
    return report


def _release_dead(engine: sa.Engine, settings: Settings, report: SweepReport) -> None:
    with engine.begin() as conn:
        report.dead_workers = ledger.stop_silent_workers(
            conn, dead_after_s=settings.worker_dead_after_s
        )
    for name in report.dead_workers:
        log.warning("worker %s stopped heartbeating; releasing its items", name)

    with reads(engine).connect() as conn:
        owners = ledger.owners_to_release(conn)
    for owner, dead in owners:
        with engine.begin() as conn:
            if dead:
                report.released += ledger.release_crashed(
                    conn,
                    owner,
                    max_attempts=settings.max_attempts,
                    code="worker_lost",
                    message=f"worker {owner} died while running this item",
                )
            else:
                report.released += ledger.release_lapsed(conn, owner)


def _sweep(
    engine: sa.Engine,
    settings: Settings,
    publish: Callable[[uuid.UUID], bool],
    report: SweepReport,
) -> None:
    with reads(engine).connect() as conn:
        expired = (
            conn.execute(
                sa.text(
                    f"SELECT id FROM jobs WHERE status IN {ledger.RUNNABLE_SQL} "  # noqa: S608 - enum constants
                    "AND expires_at <= now()"
                )
            )
            .scalars()
            .all()
        )
    for job_id in expired:
        with engine.begin() as conn:
            ledger.expire_job(conn, job_id)
            report.expired_jobs += 1

    with engine.begin() as conn:
        report.finalized = ledger.finalize_jobs(conn)
    report.batch_files = batches.make_due_files(engine)

    # Files past their expires_at: their bytes go, a bounded number per pass.
    with engine.begin() as conn:
        report.files_expired = ledger.expire_files(conn, EXPIRED_FILES_PER_SWEEP)
    if report.files_expired:
        log.info("removed %d expired file(s)", report.files_expired)

    with reads(engine).connect() as conn:
        live = live_workers(conn, dead_after_s=settings.worker_dead_after_s)
        stale = ledger.stale_jobs(conn, stale_s=settings.hint_stale_s, models=sorted(live))
    for job_id in stale:
        if not publish(job_id):
            break  # Redis is away; the next pass tries again
        with engine.begin() as conn:
            ledger.mark_hinted(conn, job_id)
        report.republished.append(job_id)
    if report.republished:
        log.info("re-enqueued %d job(s) with no sign of life", len(report.republished))
