"""Claiming: leasing pending items of a runnable job to a worker, either in seq order or, for
the items that were in flight when an engine died, one group of suspects at a time."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import lock_jobs
from thinkbatch.ledger.rows import Claimed
from thinkbatch.ledger.statuses import RUNNABLE
from thinkbatch.models import JobStatus

# Lease the picked items to :owner and count the attempt; shared by both claims below.
_LEASE_PICKED = """
    UPDATE items AS i SET
        status = 'running', attempts = i.attempts + 1, lease_owner = :owner,
        lease_expires_at = now() + make_interval(secs => :lease_s),
        started_at = coalesce(i.started_at, now())
    FROM picked WHERE i.id = picked.id
    RETURNING i.id, i.job_id, i.seq, i.custom_id, i.messages, i.prompt, i.params,
              i.attempts, i.crashes
"""

_CLAIM = sa.text(
    """
    WITH picked AS (
        SELECT id FROM items
        WHERE job_id = :job_id AND status = 'pending' AND crashes = 0
        ORDER BY seq LIMIT :n
        FOR UPDATE SKIP LOCKED
    )
    """  # noqa: S608 - two constants joined at import
    + _LEASE_PICKED
)

# Items that were in flight when an engine or a worker died are suspects. They run apart from
# everything else, the most-crashed tier in two halves, so a poison item is cornered in a few
# engine deaths and its batch-mates are not charged for it (see `release_crashed`). A tier's
# size counts its members that already finished, so the second half runs whole instead of
# being halved again.
_CLAIM_SUSPECTS = sa.text(
    """
    WITH top AS (
        SELECT max(crashes) AS crashes FROM items
        WHERE job_id = :job_id AND status = 'pending' AND crashes > 0
    ), tier AS (
        SELECT count(*) AS n FROM items
        WHERE job_id = :job_id AND crashes = (SELECT crashes FROM top)
    ), picked AS (
        SELECT id FROM items
        WHERE job_id = :job_id AND status = 'pending' AND crashes = (SELECT crashes FROM top)
        ORDER BY seq
        LIMIT (SELECT greatest(1, ceil(n / 2.0))::int FROM tier)
        FOR UPDATE SKIP LOCKED
    )
    """  # noqa: S608 - two constants joined at import
    + _LEASE_PICKED
)


def claim(
    conn: sa.Connection,
    job_id: uuid.UUID,
    *,
    owner: str,
    n: int,
    lease_s: float,
    suspects: bool = False,
) -> list[Claimed]:
    """Lease up to `n` pending items of a runnable job (or one group of suspects) to `owner`."""
    # Suspects are claimed one group at a time (the halving in _CLAIM_SUSPECTS counts what
    # the others took): their claims exclude each other, as stores of the job do.
    state = lock_jobs(conn, [job_id], Lock.items if suspects else Lock.claim).get(job_id)
    if state is None or state.status not in RUNNABLE or state.expired:
        return []
    if n <= 0 and not suspects:
        return []
    statement = _CLAIM_SUSPECTS if suspects else _CLAIM
    params: dict[str, Any] = {"job_id": job_id, "owner": owner, "lease_s": lease_s}
    if not suspects:
        params["n"] = n
    rows = conn.execute(statement, params).all()
    if rows and state.status == JobStatus.queued:
        conn.execute(
            sa.text(
                "UPDATE jobs SET status = 'running', started_at = coalesce(started_at, now()) "
                "WHERE id = :id AND status = 'queued'"
            ),
            {"id": job_id},
        )
    claimed = [Claimed(*row) for row in rows]
    claimed.sort(key=lambda c: c.seq)
    return claimed


def has_suspects(conn: sa.Connection, job_id: uuid.UUID) -> bool:
    return bool(
        conn.execute(
            sa.text(
                "SELECT EXISTS (SELECT 1 FROM items WHERE job_id = :id AND status = 'pending' "
                "AND crashes > 0)"
            ),
            {"id": job_id},
        ).scalar()
    )
