"""A job's counts on its row: its items that left `unfinished` (pending or running) for each
final status, and the tokens of its stored results.

The statements that end items add to them here, from what those statements return, rather than
a trigger on every UPDATE of `items` (migration 0008): a statement trigger with transition
tables copies every updated row, claims included, whose pending -> running moves change no
count; and it wrote the job's row inside the store's statement, whose lock the store then held
for the rest of its work. Here the row is written once, at the end of each ending write, so a
job's row is held only from there to the commit, and its other workers' stores overlap.
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

_ADD = sa.text(
    """
    UPDATE jobs AS j SET
        unfinished = j.unfinished - (d.succeeded + d.failed + d.cancelled + d.expired),
        succeeded = j.succeeded + d.succeeded,
        failed = j.failed + d.failed,
        cancelled = j.cancelled + d.cancelled,
        expired = j.expired + d.expired,
        prompt_tokens = j.prompt_tokens + d.prompt_tokens,
        completion_tokens = j.completion_tokens + d.completion_tokens,
        reasoning_tokens = j.reasoning_tokens + d.reasoning_tokens
    FROM unnest(CAST(:ids AS uuid[]), CAST(:succeeded AS int[]), CAST(:failed AS int[]),
                CAST(:cancelled AS int[]), CAST(:expired AS int[]),
                CAST(:prompt_tokens AS bigint[]), CAST(:completion_tokens AS bigint[]),
                CAST(:reasoning_tokens AS bigint[]))
         AS d(id, succeeded, failed, cancelled, expired, prompt_tokens, completion_tokens,
              reasoning_tokens)
    WHERE j.id = d.id
    """
)


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


def add(conn: sa.Connection, counts: Counts) -> None:
    """Add `counts` to their jobs' rows, which this takes in id order (the first rule in the
    package's docstring) and holds until the transaction ends."""
    ids = sorted(counts.by_job)
    if not ids:
        return
    if len(ids) > 1:  # one row needs no order; the UPDATE takes its lock
        lock_jobs(conn, ids, Lock.items)
    deltas = [counts.by_job[i] for i in ids]
    params: dict[str, list[object]] = {"ids": list(ids)}
    for status in _ENDED:
        params[status] = [d.ended[status] for d in deltas]
    for k, name in enumerate(("prompt_tokens", "completion_tokens", "reasoning_tokens")):
        params[name] = [d.tokens[k] for d in deltas]
    conn.execute(_ADD, params)


def add_ended(conn: sa.Connection, rows: Iterable[Any]) -> None:
    """Add the (job id, new status) of each item a statement moved (its RETURNING rows)."""
    counts = Counts()
    for job_id, status in rows:
        counts.ended(job_id, status)
    add(conn, counts)
