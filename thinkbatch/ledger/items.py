"""The end of a lease: a worker's fenced writes to the items it holds (results, failures, ends
of aborted items, releases at shutdown; the second rule in the package's docstring) and the
release of the items of an owner that crashed or whose lease lapsed. Each release then ends
the items of a job cancelled meanwhile (jobs.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from thinkbatch.ledger import counts
from thinkbatch.ledger.jobs import _end_unclaimable
from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import lock_jobs
from thinkbatch.ledger.rows import Done
from thinkbatch.ledger.rows import Failed
from thinkbatch.ledger.statuses import RUNNABLE_SQL
from thinkbatch.models import ItemStatus

# The fence of a worker's write: the item is still `running` under this owner and attempt. It is
# one opaque expression on purpose: written as three conditions, the planner answers
# `status = 'running'` from the partial index on running items, which under a fast churn of
# claims and results holds tens of thousands of dead entries its statistics do not know about,
# and then joins that scan against every row of the batch (a 500-row store took 0.5 s in
# Postgres instead of 0.04 s). As one expression it looks each item up by its primary key.
_FENCE = (
    "(CASE WHEN i.status = 'running' AND i.lease_owner = :owner THEN i.attempts END) = v.attempt"
)

_COMPLETE = sa.text(
    f"""
    WITH v AS (
        SELECT * FROM json_to_recordset(CAST(:rows AS json)) AS v(
            item_id bigint, job_id uuid, attempt int, thinking text, answer text,
            finish_reason text, thinking_truncated bool, prompt_tokens int,
            completion_tokens int, reasoning_tokens int, choices jsonb)
    ), done AS (
        UPDATE items AS i SET
            status = 'succeeded', finished_at = now(), lease_owner = NULL,
            lease_expires_at = NULL, error_code = NULL, error_message = NULL
        FROM v
        WHERE i.id = v.item_id AND {_FENCE}
        RETURNING i.id
    )
    INSERT INTO item_results (
        item_id, job_id, attempt, thinking, answer, finish_reason, thinking_truncated,
        prompt_tokens, completion_tokens, reasoning_tokens, choices, worker_id)
    SELECT v.item_id, v.job_id, v.attempt, v.thinking, v.answer, v.finish_reason,
           v.thinking_truncated, v.prompt_tokens, v.completion_tokens, v.reasoning_tokens,
           v.choices, :owner
    FROM v JOIN done ON done.id = v.item_id
    ON CONFLICT (item_id) DO NOTHING
    RETURNING item_id
    """  # noqa: S608 - _FENCE is a constant
)


def results_json(done: Sequence[Done]) -> str:
    """The `:rows` of _COMPLETE: the batch as one JSON document. psycopg adapts ten arrays
    element by element, and json.dumps does the same in C (25 -> 14 us of worker CPU per
    result, 500-row batches)."""
    return json.dumps(
        [
            {
                "item_id": d.item_id,
                "job_id": str(d.job_id),
                "attempt": d.attempt,
                # Postgres text cannot hold NUL; a model can emit it.
                "thinking": d.thinking.replace("\x00", ""),
                "answer": d.answer.replace("\x00", ""),
                "finish_reason": d.finish_reason,
                "thinking_truncated": d.thinking_truncated,
                "prompt_tokens": d.prompt_tokens,
                "completion_tokens": d.completion_tokens,
                "reasoning_tokens": d.reasoning_tokens,
                "choices": _without_nul(d.choices) if d.choices is not None else None,
            }
            for d in done
        ],
        ensure_ascii=False,
    )


def _without_nul(value: Any) -> Any:
    """Postgres holds no NUL in text nor in jsonb strings; a model can emit it."""
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_nul(v) for k, v in value.items()}
    return value


def complete(
    conn: sa.Connection,
    owner: str,
    done: Sequence[Done],
    counted: counts.Counts | None = None,
) -> set[int]:
    """Store results whose lease still stands; returns the ids that were stored.

    Their jobs' counts go to `counted`, for the caller to add with the rest of its
    transaction's (`counts.add`), or are added here when it is None."""
    if not done:
        return set()
    batch = results_json(done)
    # The share lock keeps a cancel or an expiry out until the commit, and lets the other
    # workers of the same jobs store theirs meanwhile: their rows are written once, last.
    lock_jobs(conn, (d.job_id for d in done), Lock.work)
    stored = {row.item_id for row in conn.execute(_COMPLETE, {"owner": owner, "rows": batch})}
    # Summed by job in a plain loop first: this runs per stored result, on the worker's writer.
    sums: dict[uuid.UUID, list[int]] = {}
    for d in done:
        if d.item_id in stored:
            s = sums.get(d.job_id)
            if s is None:
                s = sums[d.job_id] = [0, 0, 0, 0]
            s[0] += 1
            s[1] += d.prompt_tokens
            s[2] += d.completion_tokens
            s[3] += d.reasoning_tokens
    moved = counts.Counts() if counted is None else counted
    for job_id, (n, prompt, completion, reasoning) in sums.items():
        moved.ended(job_id, "succeeded", n)
        moved.tokens(job_id, prompt, completion, reasoning)
    if counted is None:
        counts.add(conn, moved)
    return stored


# A retry goes back to pending only while its job is runnable: nobody claims for a cancelling
# job, so a pending item would keep it `cancelling` for good.
_FAIL = sa.text(
    f"""
    UPDATE items AS i SET
        status = CASE WHEN v.retryable AND i.attempts < :max_attempts
                           AND j.status IN {RUNNABLE_SQL}
                      THEN 'pending' ELSE 'failed' END,
        finished_at = CASE WHEN v.retryable AND i.attempts < :max_attempts
                                AND j.status IN {RUNNABLE_SQL}
                           THEN NULL ELSE now() END,
        lease_owner = NULL, lease_expires_at = NULL,
        error_code = v.code, error_message = v.message
    FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]), CAST(:codes AS text[]),
                CAST(:messages AS text[]), CAST(:retryable AS bool[]))
         AS v(item_id, attempt, code, message, retryable), jobs AS j
    WHERE i.id = v.item_id AND {_FENCE} AND j.id = i.job_id
    RETURNING i.id, i.job_id, i.status
    """  # noqa: S608 - RUNNABLE_SQL is made of enum constants
)


def fail(
    conn: sa.Connection,
    owner: str,
    failed: Sequence[Failed],
    *,
    max_attempts: int,
    counted: counts.Counts | None = None,
) -> dict[int, str]:
    """Record failures: retryable ones go back to pending until the attempt cap. `counted`:
    as in `complete`."""
    if not failed:
        return {}
    lock_jobs(conn, (f.job_id for f in failed), Lock.work)  # as in `complete`
    rows = conn.execute(
        _FAIL,
        {
            "owner": owner,
            "max_attempts": max_attempts,
            "item_ids": [f.item_id for f in failed],
            "attempts": [f.attempt for f in failed],
            "codes": [f.code for f in failed],
            "messages": [f.message[:4000] for f in failed],
            "retryable": [f.retryable for f in failed],
        },
    ).all()
    _count(conn, ((row.job_id, row.status) for row in rows), counted)
    return {row.id: row.status for row in rows}


def _count(
    conn: sa.Connection, moved: Iterable[tuple[uuid.UUID, str]], counted: counts.Counts | None
) -> None:
    """Count the (job id, new status) of moved items into `counted`, or add them now."""
    if counted is None:
        counts.add_ended(conn, moved)
        return
    for job_id, status in moved:
        counted.ended(job_id, status)


def _update_held(
    conn: sa.Connection,
    owner: str,
    items: Sequence[tuple[int, uuid.UUID, int]],
    assignments: str,
    params: dict[str, Any],
    counted: counts.Counts | None = None,
) -> int:
    """Lock the items' jobs, then apply `assignments` (an SQL SET list) to each (item id, job
    id, attempt) that `owner` still holds under that attempt (the fence), and count the items
    that ended."""
    lock_jobs(conn, (job_id for _, job_id, _ in items), Lock.work)  # as in `complete`
    rows = conn.execute(
        sa.text(
            f"""
            UPDATE items AS i SET {assignments}
            FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]))
                 AS v(item_id, attempt)
            WHERE i.id = v.item_id AND {_FENCE}
            RETURNING i.job_id, i.status
            """  # noqa: S608 - the assignments are constants of this module, _FENCE too
        ),
        {
            **params,
            "owner": owner,
            "item_ids": [i for i, _, _ in items],
            "attempts": [a for _, _, a in items],
        },
    ).all()
    _count(conn, ((row.job_id, row.status) for row in rows), counted)
    return len(rows)


def end_items(
    conn: sa.Connection,
    owner: str,
    items: Sequence[tuple[int, uuid.UUID, int]],
    *,
    status: ItemStatus,
    code: str,
    message: str,
    counted: counts.Counts | None = None,
) -> int:
    """End in-flight items of a cancelled or expired job (aborted in the engine). `counted`:
    as in `complete`."""
    if not items:
        return 0
    return _update_held(
        conn,
        owner,
        items,
        "status = :status, finished_at = now(), lease_owner = NULL, lease_expires_at = NULL, "
        "error_code = :code, error_message = :message",
        {"status": status.value, "code": code, "message": message},
        counted,
    )


def release(conn: sa.Connection, owner: str, items: Sequence[tuple[int, uuid.UUID, int]]) -> int:
    """Hand items back untouched (graceful shutdown): pending again, the attempt refunded."""
    if not items:
        return 0
    released = _update_held(
        conn,
        owner,
        items,
        "status = 'pending', attempts = greatest(i.attempts - 1, 0), lease_owner = NULL, "
        "lease_expires_at = NULL",
        {},
    )
    _end_unclaimable(conn, (job_id for _, job_id, _ in items))
    return released


_HELD_JOBS = "SELECT DISTINCT job_id FROM items WHERE status = 'running' AND lease_owner = :o"
_LAPSED = " AND lease_expires_at < now()"


def _lock_held_jobs(conn: sa.Connection, owner: str, *, lapsed: bool = False) -> list[uuid.UUID]:
    """Lock the jobs of the items `owner` holds (only those whose lease lapsed, with `lapsed`),
    before those items are released; returns their ids."""
    query = _HELD_JOBS + (_LAPSED if lapsed else "")
    job_ids = [row.job_id for row in conn.execute(sa.text(query), {"o": owner})]
    if job_ids:
        lock_jobs(conn, job_ids)
    return job_ids


_RELEASE_CRASHED = sa.text(
    """
    UPDATE items AS i SET
        status = CASE WHEN :alone AND i.attempts >= :max_attempts THEN 'failed'
                      ELSE 'pending' END,
        finished_at = CASE WHEN :alone AND i.attempts >= :max_attempts THEN now() END,
        attempts = CASE WHEN :alone THEN i.attempts ELSE greatest(i.attempts - 1, 0) END,
        crashes = i.crashes + 1,
        lease_owner = NULL, lease_expires_at = NULL,
        error_code = :code, error_message = :message
    WHERE i.status = 'running' AND i.lease_owner = :owner
    RETURNING i.job_id, i.status
    """
)


def release_crashed(
    conn: sa.Connection, owner: str, *, max_attempts: int, code: str, message: str
) -> int:
    """Release every item `owner` held when its engine or process died.

    Which item killed it is unknown, so all of them become suspects (crashes + 1). A crash
    with several items in flight charges none of them an attempt; a crash with one item alone
    charges it, and at the attempt cap that item fails: a poison item ends `failed` while its
    batch-mates are retried in halves until it is cornered.
    """
    job_ids = _lock_held_jobs(conn, owner)
    if not job_ids:
        return 0
    held = conn.execute(
        sa.text("SELECT count(*) FROM items WHERE status = 'running' AND lease_owner = :o"),
        {"o": owner},
    ).scalar_one()
    rows = conn.execute(
        _RELEASE_CRASHED,
        {
            "owner": owner,
            "alone": held == 1,
            "max_attempts": max_attempts,
            "code": code,
            "message": message,
        },
    ).all()
    counts.add_ended(conn, ((row.job_id, row.status) for row in rows))
    _end_unclaimable(conn, job_ids)
    _hint_again(conn, job_ids)
    return len(rows)


def release_lapsed(conn: sa.Connection, owner: str) -> int:
    """Items whose lease lapsed under a worker that is still alive: back to pending, the
    attempt counted. A late result from that worker is then fenced out."""
    job_ids = _lock_held_jobs(conn, owner, lapsed=True)
    if not job_ids:
        return 0
    result = conn.execute(
        sa.text(
            "UPDATE items SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, "
            "error_code = 'lease_expired', error_message = 'no result before the lease lapsed' "
            "WHERE status = 'running' AND lease_owner = :o AND lease_expires_at < now()"
        ),
        {"o": owner},
    )
    _end_unclaimable(conn, job_ids)
    _hint_again(conn, job_ids)
    return result.rowcount


def _hint_again(conn: sa.Connection, job_ids: list[uuid.UUID]) -> None:
    """Have the sweeper's next re-hint include these jobs (hinted_at NULL is stale at once):
    their released items need a worker of their model, and the worker that keeps the job
    looking alive may serve only its other models, so the job would not look stale."""
    conn.execute(sa.text("UPDATE jobs SET hinted_at = NULL WHERE id = ANY(:ids)"), {"ids": job_ids})
