"""Changes of a job's status: finalizing jobs whose items are all terminal, expiring, failing
and cancelling a job, and ending the pending items of a cancelling job, which the releases
in items.py call too."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from thinkbatch.ledger import counts
from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import lock_jobs
from thinkbatch.ledger.statuses import RUNNABLE
from thinkbatch.ledger.statuses import UNFINISHED_SQL


@dataclass(frozen=True, slots=True)
class ToDrive:
    """What a worker needs of a job it is asked to drive."""

    model: str
    params: dict[str, Any]
    priority: int
    status: str
    tenant: str
    created_at: datetime
    models: list[str]


def job_to_drive(conn: sa.Connection, job_id: uuid.UUID) -> ToDrive | None:
    row = conn.execute(
        sa.text(
            "SELECT model, params, priority, status, tenant, created_at, models FROM jobs "
            "WHERE id = :id"
        ),
        {"id": job_id},
    ).first()
    return ToDrive(*row) if row is not None else None


def finalize_jobs(conn: sa.Connection, job_ids: Iterable[uuid.UUID] | None = None) -> int:
    """Move jobs whose items are all terminal to their final status (of `job_ids`, or every
    job), their writers' deltas folded into their rows first (counts.fold)."""
    where = "id = ANY(:ids) AND " if job_ids is not None else ""
    params: dict[str, Any] = {"ids": sorted(set(job_ids))} if job_ids is not None else {}
    if job_ids is not None and not params["ids"]:
        return 0
    counts.fold(conn, params.get("ids"))
    result = conn.execute(
        sa.text(
            f"""
            UPDATE jobs SET
                status = CASE WHEN status = 'cancelling' THEN 'cancelled'
                              WHEN expired > 0 THEN 'expired'
                              ELSE 'completed' END,
                finished_at = now()
            WHERE {where} status IN {UNFINISHED_SQL} AND unfinished = 0
            """  # noqa: S608 - `where` is one of two literals above, the set enum constants
        ),
        params,
    )
    return result.rowcount


# Every way an item goes back to pending (a release at shutdown, after a crash, or when its lease
# lapsed) can meet a job that was cancelled meanwhile. Nobody claims for a cancelling job, so those
# items would stay pending and the job `cancelling` for good: they end as cancel_job ends pending
# items, and the job is finalized.
_END_UNCLAIMABLE = sa.text(
    """
    UPDATE items AS i SET status = 'cancelled', finished_at = now(), error_code = 'cancelled',
        error_message = 'the job was cancelled'
    FROM jobs AS j
    WHERE j.id = i.job_id AND j.id = ANY(:ids) AND j.status = 'cancelling'
      AND i.status = 'pending'
    RETURNING i.job_id, i.status
    """
)


# Whether any of the jobs has nothing unfinished once its writers' deltas count (models.Job).
_DONE_ANY = sa.text(
    f"""
    SELECT EXISTS (
        SELECT 1 FROM jobs AS j
        WHERE j.id = ANY(:ids) AND j.status IN {UNFINISHED_SQL}
          AND j.unfinished = (
              SELECT coalesce(sum(d.succeeded + d.failed + d.cancelled + d.expired), 0)
              FROM job_count_deltas AS d WHERE d.job_id = j.id)
    )
    """  # noqa: S608 - the set is made of enum constants
)


def finalize_if_done(conn: sa.Connection, job_ids: Iterable[uuid.UUID]) -> int:
    """After a writer's commit: finalize those of its jobs that have nothing unfinished left.

    A store that adds to its own deltas cannot tell, in its transaction, whether another
    writer is ending a job's last items at the same moment; each of them asks here after its
    commit, and the later one sees both. A read decides, so a store of a job with work left
    writes nothing more; the sweeper's pass finalizes any a writer did not live to ask for."""
    ids = sorted(set(job_ids))
    if not ids or not conn.execute(_DONE_ANY, {"ids": ids}).scalar():
        return 0
    return finalize_jobs(conn, ids)


def _end_unclaimable(conn: sa.Connection, job_ids: Iterable[uuid.UUID]) -> None:
    ids = sorted(set(job_ids))
    if ids:
        counts.add_ended(conn, conn.execute(_END_UNCLAIMABLE, {"ids": ids}))
        finalize_jobs(conn, ids)


def expire_job(conn: sa.Connection, job_id: uuid.UUID) -> int:
    """Past its completion window: unstarted items expire (running ones are aborted by their
    workers, or released by the sweeper and expired on its next pass)."""
    state = lock_jobs(conn, [job_id], Lock.status).get(job_id)
    if state is None or state.status not in RUNNABLE or not state.expired:
        return 0
    rows = conn.execute(
        sa.text(
            "UPDATE items SET status = 'expired', finished_at = now(), error_code = 'expired', "
            "error_message = 'the job passed its completion window' "
            "WHERE job_id = :id AND status = 'pending' RETURNING job_id, status"
        ),
        {"id": job_id},
    ).all()
    counts.add_ended(conn, rows)
    finalize_jobs(conn, [job_id])
    return len(rows)


def fail_job(conn: sa.Connection, job_id: uuid.UUID, *, code: str, message: str) -> bool:
    """A job-level failure (e.g. a model no worker serves): its unstarted items fail with it."""
    state = lock_jobs(conn, [job_id], Lock.status).get(job_id)
    if state is None or state.status not in RUNNABLE:
        return False
    rows = conn.execute(
        sa.text(
            "UPDATE items SET status = 'failed', finished_at = now(), error_code = :code, "
            "error_message = :message WHERE job_id = :id AND status = 'pending' "
            "RETURNING job_id, status"
        ),
        {"id": job_id, "code": code, "message": message},
    ).all()
    counts.add_ended(conn, rows)
    conn.execute(
        sa.text(
            "UPDATE jobs SET status = 'failed', finished_at = now(), error_code = :code, "
            "error_message = :message WHERE id = :id"
        ),
        {"id": job_id, "code": code, "message": message},
    )
    return True


def cancel_job(conn: sa.Connection, job_id: uuid.UUID) -> tuple[bool, str] | None:
    """Cancel: pending items end at once; running ones are aborted by their workers.

    Returns (whether this call cancelled it, the job's status afterwards), or None when there
    is no such job. A job that was no longer queued or running is left as it was.
    """
    state = lock_jobs(conn, [job_id], Lock.status).get(job_id)
    if state is None:
        return None
    if state.status not in RUNNABLE:
        return False, state.status
    # cancelling_at: when the cancel was asked (a batch shows it).
    conn.execute(
        sa.text("UPDATE jobs SET status = 'cancelling', cancelling_at = now() WHERE id = :id"),
        {"id": job_id},
    )
    _end_unclaimable(conn, [job_id])  # its pending items end now, as released ones will later
    status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id})
    return True, status.scalar_one()
