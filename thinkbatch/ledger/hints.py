"""Hints: recording that a job's hint was sent, and finding the jobs an idle worker may adopt
or whose hint went stale."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import sqlalchemy as sa

from thinkbatch.ledger.claims import FRESH
from thinkbatch.ledger.claims import SUSPECT
from thinkbatch.ledger.claims import any_item
from thinkbatch.ledger.claims import any_named
from thinkbatch.ledger.statuses import RUNNABLE_SQL

# hinted_at is compared with the database's now() by the sweeper (HINT_STALE_S), so it is
# written with that clock too: a host whose clock runs behind would otherwise make its hints
# look stale (and re-sent) or fresh for too long.


def mark_hinted(conn: sa.Connection, job_id: uuid.UUID, *, unless_busy: bool = False) -> None:
    """Record that a hint for the job was just sent (or that a task is driving it).

    `unless_busy`: a task's heartbeat, skipped while another transaction holds the job's row
    (a store adding to its counts: the job is alive), rather than queued behind it as each
    of a fleet's workers would be, every heartbeat. A missed beat costs at most a hint sent
    again, which the claims make harmless.
    """
    if unless_busy:
        conn.execute(_MARK_UNLESS_BUSY, {"id": job_id})
    else:
        conn.execute(sa.text("UPDATE jobs SET hinted_at = now() WHERE id = :id"), {"id": job_id})


_MARK_UNLESS_BUSY = sa.text(
    "UPDATE jobs SET hinted_at = now() "
    "WHERE id = (SELECT id FROM jobs WHERE id = :id FOR NO KEY UPDATE SKIP LOCKED)"
)


# A job with items nobody has claimed. `unfinished` (one column) rules out finished jobs first;
# the pending items are then looked up in the job's range of ix_items_job_id_status_seq.
_HAS_PENDING = (
    "jobs.unfinished > 0 AND EXISTS (SELECT 1 FROM items "
    "WHERE items.job_id = jobs.id AND items.status = 'pending')"
)


# ... and pending items of one of :models (an item's NULL model is its job's). Asked by every
# idle worker each heartbeat and by the sweeper, so each arm is one a partial index answers,
# as in claims.has_pending: the items of each name and the job's own ones (only when the job's
# model is among :models) from ix_items_pending, the suspects from ix_items_pending_suspects.
# `coalesce(items.model, jobs.model) = ANY(:models)` in one condition reads every pending item
# of a job whose remaining work is all another model's.
_HAS_PENDING_OF = (
    "jobs.unfinished > 0 AND jobs.models ?| CAST(:models AS text[]) AND ("
    + any_named("jobs.id", ":models")
    + " OR (jobs.model = ANY(:models) AND "
    + any_item("jobs.id", FRESH + " AND items.model IS NULL", "model, prefix_key, seq")
    + ") OR "
    + any_item(
        "jobs.id", SUSPECT + " AND coalesce(items.model, jobs.model) = ANY(:models)", "crashes, seq"
    )
    + ")"
)


def job_to_adopt(
    conn: sa.Connection, *, models: Sequence[str], exclude: Sequence[uuid.UUID]
) -> uuid.UUID | None:
    """The most urgent runnable job with unclaimed items of `models`, but those in `exclude`:
    one an idle worker of those models may take a share of."""
    return conn.execute(
        sa.text(
            f"""
            SELECT id FROM jobs
            WHERE status IN {RUNNABLE_SQL} AND {_HAS_PENDING_OF}
              AND expires_at > now() AND NOT (id = ANY(:exclude))
            ORDER BY priority DESC, created_at LIMIT 1
            """  # noqa: S608 - RUNNABLE_SQL and _HAS_PENDING_OF are constants
        ),
        {"models": list(models), "exclude": list(exclude)},
    ).scalar()


def stale_jobs(
    conn: sa.Connection, *, stale_s: float, models: Sequence[str] | None = None
) -> list[uuid.UUID]:
    """Runnable jobs with pending items and no hint for `stale_s` seconds: a lost or
    never-sent hint. Most urgent first. With `models` (those a live worker serves), only the
    jobs of those: a job whose models have no live worker waits for one, which adopts it."""
    where = _HAS_PENDING if models is None else _HAS_PENDING_OF
    params: dict[str, object] = {"s": stale_s}
    if models is not None:
        params["models"] = list(models)
    return list(
        conn.execute(
            sa.text(
                f"""
                SELECT id FROM jobs
                WHERE status IN {RUNNABLE_SQL} AND {where}
                  AND (hinted_at IS NULL OR hinted_at < now() - make_interval(secs => :s))
                ORDER BY priority DESC, created_at
                """  # noqa: S608 - RUNNABLE_SQL and the two conditions are constants
            ),
            params,
        ).scalars()
    )


def job_models(conn: sa.Connection, job_id: uuid.UUID) -> list[str]:
    """The distinct models of a job's items: the queues its hints go to."""
    models = conn.execute(
        sa.text("SELECT models FROM jobs WHERE id = :id"), {"id": job_id}
    ).scalar()
    return list(models or ())
