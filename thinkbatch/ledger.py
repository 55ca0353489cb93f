"""Every state change of items, as fenced SQL on one connection. The worker, the sweeper and
the API's cancel all go through here.

Two rules keep this correct under concurrency:

* A transaction that changes items first locks their job rows, in id order (`lock_jobs`), in
  one of three strengths (`Lock`). The count triggers update those rows anyway; taking the locks
  up front, in one order, means two transactions can never deadlock over them. A claim takes the
  weakest, which a store's update of the same job's counts does not wait for (nor it for the
  store: a claim changes no count, migration 0004); a change of the job's status takes the
  strongest, so a cancel cannot interleave with a claim.
* A write from a worker is fenced: it applies only while the item is still `running` under the
  same `lease_owner` and `attempts` that the claim handed out. A late, duplicate or superseded
  delivery therefore changes nothing, and an item holds at most one result (primary key).
"""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Iterable
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from thinkbatch.models import ItemStatus
from thinkbatch.models import JobStatus

RUNNABLE = (JobStatus.queued.value, JobStatus.running.value)
# Jobs not yet in a final status: the ones finalize_jobs may move on.
UNFINISHED = (*RUNNABLE, JobStatus.cancelling.value)


def sql_in(statuses: Iterable[str]) -> str:
    """A set of job statuses as an SQL list of literals, made from the model's enums so that one
    definition serves every module. Literals rather than a bound array: the partial indexes
    (models.py) match only a query that names the same constants."""
    return "(" + ", ".join(f"'{JobStatus(s).value}'" for s in statuses) + ")"


RUNNABLE_SQL = sql_in(RUNNABLE)
UNFINISHED_SQL = sql_in(UNFINISHED)


# Not frozen: built once per item on the hot path, where a frozen dataclass's __init__
# (object.__setattr__ per field) cost ~10x a plain one (bench/throughput.py, ceiling).
@dataclass(slots=True)
class Claimed:
    id: int
    job_id: uuid.UUID
    seq: int
    custom_id: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any] | None
    attempt: int
    crashes: int


@dataclass(slots=True)  # not frozen: see Claimed
class Done:
    """A finished generation, ready to store."""

    item_id: int
    job_id: uuid.UUID
    attempt: int
    thinking: str
    answer: str
    finish_reason: str
    thinking_truncated: bool
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    item_id: int
    job_id: uuid.UUID
    attempt: int
    code: str
    message: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class JobState:
    id: uuid.UUID
    status: str
    expired: bool
    pending: int
    running: int
    total: int
    done: int


@dataclass(frozen=True, slots=True)
class Locked:
    """What a transaction that locked a job needs to know of it."""

    id: uuid.UUID
    status: str
    expired: bool


class Lock(enum.Enum):
    """How strongly a transaction locks its jobs' rows (Postgres row-level lock modes).

    `claim` conflicts only with `status`; `items` with `items` and `status`; `status` with all.
    """

    # Moves items between pending and running, which changes no count of the job.
    claim = "KEY SHARE"
    # Changes items' counts (the triggers update the job row, which takes this lock anyway).
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
# index in the same statement, so the two add up (models.py, Job.running).
_JOB_STATE = sa.text(
    """
    SELECT id, status, expires_at <= now() AS expired, unfinished - r.n AS pending,
           r.n AS running, total, succeeded + failed + cancelled + expired AS done
    FROM jobs, LATERAL (
        SELECT count(*) AS n FROM items WHERE items.job_id = jobs.id AND items.status = 'running'
    ) AS r
    WHERE id = :id
    """
)


def job_state(conn: sa.Connection, job_id: uuid.UUID) -> JobState | None:
    row = conn.execute(_JOB_STATE, {"id": job_id}).first()
    return JobState(*row) if row else None


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
            completion_tokens int, reasoning_tokens int)
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
        prompt_tokens, completion_tokens, reasoning_tokens, worker_id)
    SELECT v.item_id, v.job_id, v.attempt, v.thinking, v.answer, v.finish_reason,
           v.thinking_truncated, v.prompt_tokens, v.completion_tokens, v.reasoning_tokens, :owner
    FROM v JOIN done ON done.id = v.item_id
    ON CONFLICT (item_id) DO NOTHING
    RETURNING item_id
    """  # noqa: S608 - _FENCE is a constant
)


def complete(conn: sa.Connection, owner: str, done: Sequence[Done]) -> set[int]:
    """Store results whose lease still stands; returns the ids that were stored."""
    if not done:
        return set()
    # The batch goes as one JSON document: psycopg adapts ten arrays element by element, and
    # json.dumps does the same in C (25 -> 14 us of worker CPU per result, 500-row batches).
    # Built before the jobs are locked: a claim of the same job waits for that lock.
    batch = json.dumps(
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
            }
            for d in done
        ],
        ensure_ascii=False,
    )
    lock_jobs(conn, (d.job_id for d in done))
    rows = conn.execute(_COMPLETE, {"owner": owner, "rows": batch})
    return {row.item_id for row in rows}


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
    RETURNING i.id, i.status
    """  # noqa: S608 - RUNNABLE_SQL is made of enum constants
)


def fail(
    conn: sa.Connection, owner: str, failed: Sequence[Failed], *, max_attempts: int
) -> dict[int, str]:
    """Record failures: retryable ones go back to pending until the attempt cap."""
    if not failed:
        return {}
    lock_jobs(conn, (f.job_id for f in failed))
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
    )
    return {row.id: row.status for row in rows}


def end_items(
    conn: sa.Connection,
    owner: str,
    items: Sequence[tuple[int, uuid.UUID, int]],
    *,
    status: ItemStatus,
    code: str,
    message: str,
) -> int:
    """End in-flight items of a cancelled or expired job (aborted in the engine)."""
    if not items:
        return 0
    lock_jobs(conn, (job_id for _, job_id, _ in items))
    result = conn.execute(
        sa.text(
            f"""
            UPDATE items AS i SET status = :status, finished_at = now(), lease_owner = NULL,
                lease_expires_at = NULL, error_code = :code, error_message = :message
            FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]))
                 AS v(item_id, attempt)
            WHERE i.id = v.item_id AND {_FENCE}
            """  # noqa: S608 - _FENCE is a constant
        ),
        {
            "status": status.value,
            "code": code,
            "message": message,
            "owner": owner,
            "item_ids": [i for i, _, _ in items],
            "attempts": [a for _, _, a in items],
        },
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
    """
)


def _end_unclaimable(conn: sa.Connection, job_ids: Iterable[uuid.UUID]) -> None:
    ids = sorted(set(job_ids))
    if ids:
        conn.execute(_END_UNCLAIMABLE, {"ids": ids})
        finalize_jobs(conn, ids)


def release(conn: sa.Connection, owner: str, items: Sequence[tuple[int, uuid.UUID, int]]) -> int:
    """Hand items back untouched (graceful shutdown): pending again, the attempt refunded."""
    if not items:
        return 0
    lock_jobs(conn, (job_id for _, job_id, _ in items))
    result = conn.execute(
        sa.text(
            f"""
            UPDATE items AS i SET status = 'pending', attempts = greatest(i.attempts - 1, 0),
                lease_owner = NULL, lease_expires_at = NULL
            FROM unnest(CAST(:item_ids AS bigint[]), CAST(:attempts AS int[]))
                 AS v(item_id, attempt)
            WHERE i.id = v.item_id AND {_FENCE}
            """  # noqa: S608 - _FENCE is a constant
        ),
        {
            "owner": owner,
            "item_ids": [i for i, _, _ in items],
            "attempts": [a for _, _, a in items],
        },
    )
    _end_unclaimable(conn, (job_id for _, job_id, _ in items))
    return result.rowcount


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
    job_ids = [
        row.job_id
        for row in conn.execute(
            sa.text(
                "SELECT DISTINCT job_id FROM items WHERE status = 'running' AND lease_owner = :o"
            ),
            {"o": owner},
        )
    ]
    if not job_ids:
        return 0
    lock_jobs(conn, job_ids)
    held = conn.execute(
        sa.text("SELECT count(*) FROM items WHERE status = 'running' AND lease_owner = :o"),
        {"o": owner},
    ).scalar_one()
    result = conn.execute(
        _RELEASE_CRASHED,
        {
            "owner": owner,
            "alone": held == 1,
            "max_attempts": max_attempts,
            "code": code,
            "message": message,
        },
    )
    _end_unclaimable(conn, job_ids)
    return result.rowcount


def finalize_jobs(conn: sa.Connection, job_ids: Iterable[uuid.UUID] | None = None) -> int:
    """Move jobs whose items are all terminal to their final status."""
    where = "id = ANY(:ids) AND " if job_ids is not None else ""
    params: dict[str, Any] = {"ids": sorted(set(job_ids))} if job_ids is not None else {}
    if job_ids is not None and not params["ids"]:
        return 0
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


def expire_job(conn: sa.Connection, job_id: uuid.UUID) -> int:
    """Past its completion window: unstarted items expire (running ones are aborted by their
    workers, or released by the sweeper and expired on its next pass)."""
    state = lock_jobs(conn, [job_id], Lock.status).get(job_id)
    if state is None or state.status not in RUNNABLE or not state.expired:
        return 0
    result = conn.execute(
        sa.text(
            "UPDATE items SET status = 'expired', finished_at = now(), error_code = 'expired', "
            "error_message = 'the job passed its completion window' "
            "WHERE job_id = :id AND status = 'pending'"
        ),
        {"id": job_id},
    )
    finalize_jobs(conn, [job_id])
    return result.rowcount


def release_lapsed(conn: sa.Connection, owner: str) -> int:
    """Items whose lease lapsed under a worker that is still alive: back to pending, the
    attempt counted. A late result from that worker is then fenced out."""
    job_ids = [
        row.job_id
        for row in conn.execute(
            sa.text(
                "SELECT DISTINCT job_id FROM items WHERE status = 'running' "
                "AND lease_owner = :o AND lease_expires_at < now()"
            ),
            {"o": owner},
        )
    ]
    if not job_ids:
        return 0
    lock_jobs(conn, job_ids)
    result = conn.execute(
        sa.text(
            "UPDATE items SET status = 'pending', lease_owner = NULL, lease_expires_at = NULL, "
            "error_code = 'lease_expired', error_message = 'no result before the lease lapsed' "
            "WHERE status = 'running' AND lease_owner = :o AND lease_expires_at < now()"
        ),
        {"o": owner},
    )
    _end_unclaimable(conn, job_ids)
    return result.rowcount


def fail_job(conn: sa.Connection, job_id: uuid.UUID, *, code: str, message: str) -> bool:
    """A job-level failure (e.g. a model no worker serves): its unstarted items fail with it."""
    state = lock_jobs(conn, [job_id], Lock.status).get(job_id)
    if state is None or state.status not in RUNNABLE:
        return False
    conn.execute(
        sa.text(
            "UPDATE items SET status = 'failed', finished_at = now(), error_code = :code, "
            "error_message = :message WHERE job_id = :id AND status = 'pending'"
        ),
        {"id": job_id, "code": code, "message": message},
    )
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
    conn.execute(sa.text("UPDATE jobs SET status = 'cancelling' WHERE id = :id"), {"id": job_id})
    _end_unclaimable(conn, [job_id])  # its pending items end now, as released ones will later
    status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id})
    return True, status.scalar_one()


# --- hints ---------------------------------------------------------------------------------
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


# --- the workers table -----------------------------------------------------------------------
# Every statement on it is here, and all of them use the database's clock: heartbeats are
# judged by other hosts, whose clocks may differ from the one that wrote them.


def register_worker(
    conn: sa.Connection, worker_id: str, *, hostname: str, pid: int, model: str
) -> None:
    conn.execute(
        sa.text("INSERT INTO workers (id, hostname, pid, model) VALUES (:id, :host, :pid, :model)"),
        {"id": worker_id, "host": hostname, "pid": pid, "model": model},
    )


def beat(conn: sa.Connection, worker_id: str) -> None:
    """The worker is alive (again: a worker judged dead during an outage comes back)."""
    conn.execute(
        sa.text("UPDATE workers SET heartbeat_at = now(), stopped_at = NULL WHERE id = :id"),
        {"id": worker_id},
    )


def mark_stopped(conn: sa.Connection, worker_id: str) -> None:
    conn.execute(sa.text("UPDATE workers SET stopped_at = now() WHERE id = :id"), {"id": worker_id})


def stop_silent_workers(conn: sa.Connection, *, dead_after_s: float) -> list[str]:
    """Mark workers whose heartbeat stopped `dead_after_s` ago as stopped; returns their ids."""
    return list(
        conn.execute(
            sa.text(
                "UPDATE workers SET stopped_at = now() WHERE stopped_at IS NULL "
                "AND heartbeat_at < now() - make_interval(secs => :s) RETURNING id"
            ),
            {"s": dead_after_s},
        ).scalars()
    )


def owners_to_release(conn: sa.Connection) -> list[tuple[str, bool]]:
    """Lease owners holding items that must be released: (owner, whether it is dead). A dead
    owner is unknown or stopped; a live one holds a lapsed lease."""
    rows = conn.execute(
        sa.text(
            """
            SELECT i.lease_owner, bool_or(w.id IS NULL OR w.stopped_at IS NOT NULL) AS dead
            FROM items AS i LEFT JOIN workers AS w ON w.id = i.lease_owner
            WHERE i.status = 'running'
              AND (i.lease_expires_at < now() OR w.id IS NULL OR w.stopped_at IS NOT NULL)
            GROUP BY i.lease_owner
            """
        )
    ).all()
    return [(owner, dead) for owner, dead in rows]
