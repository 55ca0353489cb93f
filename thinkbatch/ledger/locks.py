"""Locking jobs' rows, in id order and one of three strengths (the first rule in the package's
docstring), and reading a job's state with its counts."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterable

import sqlalchemy as sa

from thinkbatch.ledger.rows import JobState
from thinkbatch.ledger.rows import Locked


class Lock(enum.Enum):
    """How strongly a transaction locks its jobs' rows (Postgres row-level lock modes).

    `work` conflicts only with `status`; `items` with `items` and `status`; `status` with all.
    """

    # A claim, or a worker's write to the items it holds: any number of them at once, and no
    # change of the job's status in between.
    work = "KEY SHARE"
    # Changes the job's counts (ledger/counts.py writes the row, which takes this lock anyway).
    items = "NO KEY UPDATE"
    # Changes the job's status in a way a claim must not overlap: cancel, expire, fail.
    status = "UPDATE"


_LOCK_SQL = {
    mode: sa.text(
        f"""
        SELECT id, status, expires_at <= now() AS expired
        FROM jobs WHERE id = ANY(:ids) ORDER BY id FOR {mode.value}
        """  # noqa: S608 - one of the enum's three constants
    )
    for mode in Lock
}


def lock_jobs(
    conn: sa.Connection, job_ids: Iterable[uuid.UUID], mode: Lock = Lock.items
) -> dict[uuid.UUID, Locked]:
    ids = sorted(set(job_ids))
    if not ids:
        return {}
    rows = conn.execute(_LOCK_SQL[mode], {"ids": ids})
    return {row.id: Locked(*row) for row in rows}


# Pending is what of `unfinished` is not running; the running items are counted from their
# index in the same statement, so the two add up (models.py, Job.running). The items its
# writers ended since the job's row last took their deltas (ledger/counts.py) count as done.
_JOB_STATE = sa.text(
    """
    SELECT id, status, expires_at <= now() AS expired, unfinished - e.n - r.n AS pending,
           r.n AS running, total, succeeded + failed + cancelled + expired + e.n AS done
    FROM jobs, LATERAL (
        SELECT count(*) AS n FROM items WHERE items.job_id = jobs.id AND items.status = 'running'
    ) AS r, LATERAL (
        SELECT coalesce(sum(d.succeeded + d.failed + d.cancelled + d.expired), 0) AS n
        FROM job_count_deltas AS d WHERE d.job_id = jobs.id
    ) AS e
    WHERE id = :id
    """
)


def job_state(conn: sa.Connection, job_id: uuid.UUID) -> JobState | None:
    row = conn.execute(_JOB_STATE, {"id": job_id}).first()
    return JobState(*row) if row else None
