"""A job's counts on its row: its items that left `unfinished` (pending or running) for each
final status, and the tokens of its stored results.

The statements that end items add to them here, from what those statements return, rather than
a trigger on every UPDATE of `items` (migration 0008): a statement trigger with transition
tables copies every updated row, claims included, whose pending -> running moves change no
count; and it wrote the job's row inside the store's statement, whose lock the store then held
for the rest of its work. Here the row is written once, at the end of each ending write.

A worker's stores do not write the job's row at all (`add(..., writer=)`, migration 0009): even
written last, the row stayed locked to each store's commit, WAL flush included, and a job's
workers queued on it one commit at a time. Each writer adds to its own row of
`job_count_deltas` instead, which no other writer touches, and `fold` moves the deltas into the
jobs' rows: when a job is finalized, and on each pass of the sweeper. A job's counts as read
are its row plus its deltas (models.Job); a fold changes both in one commit, so every snapshot
sees the same sums.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import sqlalchemy as sa

from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import lock_jobs

_ENDED = ("succeeded", "failed", "cancelled", "expired")

# Adds the counts `d` (one row per job, `id`) to their jobs' rows; the writes below end with it.
_ADD_TO_JOBS = """
    UPDATE jobs AS j SET
        unfinished = j.unfinished - (d.succeeded + d.failed + d.cancelled + d.expired),
        succeeded = j.succeeded + d.succeeded,
        failed = j.failed + d.failed,
        cancelled = j.cancelled + d.cancelled,
        expired = j.expired + d.expired,
        prompt_tokens = j.prompt_tokens + d.prompt_tokens,
        completion_tokens = j.completion_tokens + d.completion_tokens,
        reasoning_tokens = j.reasoning_tokens + d.reasoning_tokens
"""
# The counts of one write, a row per job, from the arrays `add` binds.
_DELTA_ROWS = """
    FROM unnest(CAST(:ids AS uuid[]), CAST(:succeeded AS int[]), CAST(:failed AS int[]),
                CAST(:cancelled AS int[]), CAST(:expired AS int[]),
                CAST(:prompt_tokens AS bigint[]), CAST(:completion_tokens AS bigint[]),
                CAST(:reasoning_tokens AS bigint[]))
         AS d(id, succeeded, failed, cancelled, expired, prompt_tokens, completion_tokens,
              reasoning_tokens)
"""

_ADD = sa.text(_ADD_TO_JOBS + _DELTA_ROWS + "    WHERE j.id = d.id\n")


@dataclass(slots=True)
class _Delta:
    ended: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_ENDED, 0))
    tokens: list[int] = field(default_factory=lambda: [0, 0, 0])


@dataclass(slots=True)
class Counts:
    """What one write changes in its jobs' counts, gathered before it is added (`add`)."""

    by_job: dict[uuid.UUID, _Delta] = field(default_factory=dict)

    def ended(self, job_id: uuid.UUID, status: str, n: int = 1) -> None:
        """`n` unfinished items of the job ended `status` (a move back to pending is none)."""
        if status in _ENDED:
            self._delta(job_id).ended[status] += n

    def tokens(self, job_id: uuid.UUID, prompt: int, completion: int, reasoning: int) -> None:
        usage = self._delta(job_id).tokens
        usage[0] += prompt
        usage[1] += completion
        usage[2] += reasoning

    def _delta(self, job_id: uuid.UUID) -> _Delta:
        delta = self.by_job.get(job_id)
        if delta is None:
            delta = self.by_job[job_id] = _Delta()
        return delta


# A writer's deltas, added to its own rows: no other writer's transaction waits for this one.
_ADD_DELTAS = sa.text(
    """
    INSERT INTO job_count_deltas AS c (job_id, writer, succeeded, failed, cancelled, expired,
                                       prompt_tokens, completion_tokens, reasoning_tokens)
    SELECT d.id, :writer, d.succeeded, d.failed, d.cancelled, d.expired, d.prompt_tokens,
           d.completion_tokens, d.reasoning_tokens
    """
    + _DELTA_ROWS
    + """
    ON CONFLICT (job_id, writer) DO UPDATE SET
        succeeded = c.succeeded + excluded.succeeded,
        failed = c.failed + excluded.failed,
        cancelled = c.cancelled + excluded.cancelled,
        expired = c.expired + excluded.expired,
        prompt_tokens = c.prompt_tokens + excluded.prompt_tokens,
        completion_tokens = c.completion_tokens + excluded.completion_tokens,
        reasoning_tokens = c.reasoning_tokens + excluded.reasoning_tokens
    """
)


def add(conn: sa.Connection, counts: Counts, *, writer: str | None = None) -> None:
    """Add `counts` to their jobs' rows, which this takes in id order (the first rule in the
    package's docstring) and holds until the transaction ends; or, with `writer`, to that
    writer's own delta rows, leaving the jobs' rows alone (the module's docstring)."""
    ids = sorted(counts.by_job)
    if not ids:
        return
    if len(ids) > 1 and writer is None:  # one row needs no order; the UPDATE takes its lock
        lock_jobs(conn, ids, Lock.items)
    deltas = [counts.by_job[i] for i in ids]
    params: dict[str, object] = {"ids": list(ids)}
    for status in _ENDED:
        params[status] = [d.ended[status] for d in deltas]
    for k, name in enumerate(("prompt_tokens", "completion_tokens", "reasoning_tokens")):
        params[name] = [d.tokens[k] for d in deltas]
    if writer is None:
        conn.execute(_ADD, params)
    else:
        conn.execute(_ADD_DELTAS, {**params, "writer": writer})


# The deltas of the given jobs that no open transaction holds, removed and summed into their
# jobs' rows in one statement. A writer's delta row that is locked belongs to a store still
# open: it is left for the next fold, and the store's commit comes before it (skipping it
# means a fold never waits on a store, and a store never waits on a fold for long).
_FOLD = sa.text(
    f"""
    WITH free AS (
        SELECT job_id, writer FROM job_count_deltas
        WHERE job_id = ANY(:ids) FOR UPDATE SKIP LOCKED
    ), moved AS (
        DELETE FROM job_count_deltas AS c USING free
        WHERE c.job_id = free.job_id AND c.writer = free.writer
        RETURNING c.*
    ), d AS (
        SELECT job_id AS id, {", ".join(f"sum({n}) AS {n}" for n in _ENDED)},
               sum(prompt_tokens) AS prompt_tokens,
               sum(completion_tokens) AS completion_tokens,
               sum(reasoning_tokens) AS reasoning_tokens
        FROM moved GROUP BY job_id
    )
    """  # noqa: S608 - the names are the module's constants
    + _ADD_TO_JOBS
    + "    FROM d WHERE j.id = d.id\n"
)

_WITH_DELTAS = sa.text("SELECT DISTINCT job_id FROM job_count_deltas")


def fold(conn: sa.Connection, job_ids: Iterable[uuid.UUID] | None = None) -> int:
    """Move the writers' deltas of `job_ids` (of every job, with None) into the jobs' rows,
    which this locks in id order first; returns the jobs whose rows changed."""
    ids = (
        sorted(set(job_ids)) if job_ids is not None else list(conn.execute(_WITH_DELTAS).scalars())
    )
    if not ids:
        return 0
    lock_jobs(conn, ids, Lock.items)
    return conn.execute(_FOLD, {"ids": ids}).rowcount


def add_ended(conn: sa.Connection, rows: Iterable[Any]) -> None:
    """Add the (job id, new status) of each item a statement moved (its RETURNING rows)."""
    counts = Counts()
    for job_id, status in rows:
        counts.ended(job_id, status)
    add(conn, counts)
