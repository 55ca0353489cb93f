"""A job's thinking statistics, computed by SQL when read (no stored aggregate to keep right).

The reasoning share comes from the job's usage counters (kept by the result trigger). Thinking
length and truncation counts are one aggregate over the job's result rows (`item_results.job_id`
index): about 100 ms for a 100,000-item job on 2 busy cores, too much to pay on every poll of
a big job, and never done for a list of jobs. So each API process keeps the figures it computed:
a finished job's for good (its results no longer change), a running job's for STATS_TTL_S.

Truncation causes, told apart without a stored cause: cut by max_tokens means the thinking never
closed, so every completion token was thinking (`reasoning_tokens >= completion_tokens`); closed
by the budget means `</think>` came and answer tokens followed. An item whose budget closed the
thinking on the very last token max_tokens allowed has no answer either and counts as cut by
max_tokens (the budget validation keeps at least one token after the budget).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch.jobs.wire import JobStats
from thinkbatch.jobs.wire import ThinkingLength
from thinkbatch.jobs.wire import Truncations
from thinkbatch.models import ItemResult
from thinkbatch.models import Job
from thinkbatch.models import JobStatus

if TYPE_CHECKING:
    from thinkbatch.jobs.read import JobRecord

_R = ItemResult
_THOUGHT = _R.reasoning_tokens > 0


def _percentile(fraction: float) -> sa.ColumnElement[int]:
    # percentile_disc: a length some item really had, an integer like the counts it summarises.
    return sa.func.percentile_disc(fraction).within_group(_R.reasoning_tokens).filter(_THOUGHT)


_QUERY = sa.select(
    sa.func.count().filter(_THOUGHT),
    _percentile(0.5),
    _percentile(0.9),
    sa.func.max(_R.reasoning_tokens).filter(_THOUGHT),
    sa.func.count().filter(_R.thinking_truncated, _R.reasoning_tokens < _R.completion_tokens),
    sa.func.count().filter(_R.thinking_truncated, _R.reasoning_tokens >= _R.completion_tokens),
)


STATS_TTL_S = 5.0  # a running job's figures are at most this old
_CACHED_JOBS = 1024
_RUNNING = {JobStatus.queued, JobStatus.running, JobStatus.cancelling}


class _Cache:
    def __init__(self, size: int):
        self.size = size
        self.lock = threading.Lock()
        # job -> (expiry, (computed while running, figures))
        self.entries: OrderedDict[uuid.UUID, tuple[float, tuple[bool, JobStats]]] = OrderedDict()

    def get(self, key: uuid.UUID) -> tuple[bool, JobStats] | None:
        with self.lock:
            entry = self.entries.get(key)
            if entry is None or entry[0] < time.monotonic():
                return None
            self.entries.move_to_end(key)
            return entry[1]

    def put(self, key: uuid.UUID, value: tuple[bool, JobStats], ttl: float) -> None:
        with self.lock:
            self.entries[key] = (time.monotonic() + ttl, value)
            self.entries.move_to_end(key)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)


_cache = _Cache(_CACHED_JOBS)


def empty() -> JobStats:
    """The statistics of a job with no results yet (a new one): no query needed."""
    return JobStats(
        reasoning_share=None,
        thinking_tokens=ThinkingLength(items=0, p50=None, p90=None, max=None),
        thinking_truncated=Truncations(by_budget=0, by_max_tokens=0),
    )


def job_stats(session: orm.Session | sa.Connection, job: Job | JobRecord) -> JobStats:
    """The job's statistics; the caller has checked that the job is the caller's."""
    running = JobStatus(job.status) in _RUNNING
    cached = _cache.get(job.id)
    # A finished job never gets figures cached while it ran: its last results came after them.
    if cached is not None and (running or not cached[0]):
        return cached[1]
    figures = compute(session, job.id, job.reasoning_tokens, job.completion_tokens)
    _cache.put(job.id, (running, figures), STATS_TTL_S if running else float("inf"))
    return figures


def compute(
    session: orm.Session | sa.Connection,
    job_id: uuid.UUID,
    reasoning_tokens: int,
    completion_tokens: int,
) -> JobStats:
    thought, p50, p90, longest, by_budget, by_max = session.execute(
        _QUERY.where(_R.job_id == job_id)
    ).one()
    return JobStats(
        reasoning_share=reasoning_tokens / completion_tokens if completion_tokens else None,
        thinking_tokens=ThinkingLength(items=thought, p50=p50, p90=p90, max=longest),
        thinking_truncated=Truncations(by_budget=by_budget, by_max_tokens=by_max),
    )
