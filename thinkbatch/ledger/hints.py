"""Hints: recording that a job's hint was sent, and finding the jobs an idle worker may adopt
or whose hint went stale."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from thinkbatch.ledger.statuses import RUNNABLE_SQL

# hinted_at is compared with the database's now() by the sweeper (HINT_STALE_S), so it is
# written with that clock too: a host whose clock runs behind would otherwise make its hints
# look stale (and re-sent) or fresh for too long.


def mark_hinted(conn: sa.Connection, job_id: uuid.UUID) -> None:
    """Record that a hint for the job was just sent (or that a task is driving it)."""
    conn.execute(sa.text("UPDATE jobs SET hinted_at = now() WHERE id = :id"), {"id": job_id})


# A job with items nobody has claimed. `unfinished` (one column) rules out finished jobs first;
# the pending items are then looked up in the job's range of ix_items_job_id_status_seq.
_HAS_PENDING = (
    "jobs.unfinished > 0 AND EXISTS (SELECT 1 FROM items "
    "WHERE items.job_id = jobs.id AND items.status = 'pending')"
)


def job_to_adopt(
    conn: sa.Connection, *, model: str, exclude: Sequence[uuid.UUID]
) -> uuid.UUID | None:
    """The most urgent runnable job of `model` with unclaimed items, but those in `exclude`:
    one an idle worker may take a share of."""
    return conn.execute(
        sa.text(
            f"""
            SELECT id FROM jobs
            WHERE status IN {RUNNABLE_SQL} AND {_HAS_PENDING}
              AND model = :model AND expires_at > now() AND NOT (id = ANY(:exclude))
            ORDER BY priority DESC, created_at LIMIT 1
            """  # noqa: S608 - RUNNABLE_SQL and _HAS_PENDING are constants
        ),
        {"model": model, "exclude": list(exclude)},
    ).scalar()


def stale_jobs(conn: sa.Connection, *, stale_s: float) -> list[uuid.UUID]:
    """Runnable jobs with pending items and no hint for `stale_s` seconds: a lost or
    never-sent hint. Most urgent first."""
    return list(
        conn.execute(
            sa.text(
                f"""
                SELECT id FROM jobs
                WHERE status IN {RUNNABLE_SQL} AND {_HAS_PENDING}
                  AND (hinted_at IS NULL OR hinted_at < now() - make_interval(secs => :s))
                ORDER BY priority DESC, created_at
                """  # noqa: S608 - RUNNABLE_SQL and _HAS_PENDING are constants
            ),
            {"s": stale_s},
        ).scalars()
    )
