"""The shared in-flight window: the jobs this process drives, what each has in the engine,
and the one lock every part of the runner takes to change those counts."""

from __future__ import annotations

import asyncio
import enum
import itertools
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from dataclasses import field
from typing import TYPE_CHECKING
from typing import Any

from thinkbatch.ledger import Claimed
from thinkbatch.ledger import ModelFilter
from thinkbatch.models import DEFAULT_TENANT

if TYPE_CHECKING:
    from worker.engine import Prepared


class AbortReason(enum.StrEnum):
    cancelled = "cancelled"  # the job was cancelled: the item ends cancelled
    expired = "expired"  # the job passed its window: the item ends expired
    deadline = "deadline"  # no result within ITEM_DEADLINE_S: a retryable failure
    shutdown = "shutdown"  # this worker is stopping: handed back untouched


@dataclass(eq=False)
class JobHandle:
    """This process's view of one job it drives."""

    job_id: uuid.UUID
    weight: int
    params: dict[str, Any]
    # Which of the job's items this worker may claim (by model); None: all of them.
    models: ModelFilter | None = None
    tenant: str = DEFAULT_TENANT
    created_at: float = 0.0  # the job's, as a Unix time (for the latency metrics)
    inflight: int = 0  # handed to the engine, not yet returned
    finished: int = 0  # items that finished in the engine since the window's last resize
    rate: float = 0.0  # of those, per second, smoothed (InFlight.resize)
    unsettled: int = 0  # claimed, result not yet stored
    claim_open: bool = True
    # Which served name the job's next claim serves first (ledger.claim's `turn`): counted per
    # job, since one count shared by jobs claimed in alternation gives each the same turn.
    turns: Iterator[int] = field(default_factory=itertools.count)
    exhausted_until: float = 0.0  # the last claim found nothing; look again after this
    # Set by the writer when `unsettled` drops to 0 (the driving task's early wake).
    settled: threading.Event = field(default_factory=threading.Event)
    # The handle this one took the job over from at a slice hand-off; its tail is still in the
    # engine and counts towards the job's share until it drains.
    predecessor: JobHandle | None = None

    def job_inflight(self) -> int:
        """Items of this job in the engine, under this handle and the ones it took over from."""
        n, handle = self.inflight, self.predecessor
        while handle is not None:
            n += handle.inflight
            handle = handle.predecessor
        if self.predecessor is not None and n == self.inflight:
            self.predecessor = None  # drained: let it go
        return n


@dataclass(eq=False)
class Flight:
    """One item handed to the engine."""

    claimed: Claimed
    prepared: Prepared
    handle: JobHandle
    started: float
    quarantined: bool = False
    sampled: bool = False  # its per-item stages are timed (worker/stages.py)
    task: asyncio.Task[None] | None = None
    abort_reason: AbortReason | None = None  # set once it is being aborted


# How often the window's size follows the engine's rate, and how much of the rate of a tenth
# of a second ago the estimate keeps: a few tenths of a second to grow to its most, and as long
# to shrink back.
RESIZE_EVERY_S = 0.1
RATE_MEMORY = 0.5


class InFlight:
    """The window of `size` items: the claimer fills it, the engine loop empties it, and task
    threads open and close the jobs in it. Counts change only under `lock`; reads without it
    are a snapshot, which is all a decision to claim more needs.

    `size` is `base` (INFLIGHT_FACTOR) unless the engine finishes items fast: then it holds
    `lookahead_s` of what the engine finishes, up to `most`. A fixed window that a fast engine
    empties in less time than a claim takes to land leaves the engine waiting; a fixed big one
    would lease minutes of long items to one worker. Each job may hold only as much of it as
    its own items' rate calls for (`allowance`): a job whose items are slow, or not yet seen
    to finish, keeps to `base`, however fast another job's items are."""

    def __init__(self, size: int, *, most: int | None = None, lookahead_s: float = 0.0) -> None:
        self.base = size
        self.most = max(size, most or size)
        self.lookahead_s = lookahead_s
        self.size = size
        self.lock = threading.Lock()
        self.handles: dict[uuid.UUID, JobHandle] = {}
        self.count = 0  # items in the engine (or held for it: see Claimer.launch_slice)
        self.wake = threading.Event()  # room came back or a job opened: the claimer looks
        self.rate = 0.0  # items finishing in the engine per second, smoothed
        self._finished = 0  # items that finished in the engine since the last resize
        self._since = time.monotonic()

    def _held(self, rate: float) -> int:
        return max(self.base, min(self.most, int(rate * self.lookahead_s)))

    def resize(self, now: float | None = None) -> int:
        """Follow the engine's rate (from the claimer's thread, before it decides to claim):
        the size that holds `lookahead_s` of it, within [base, most]."""
        now = time.monotonic() if now is None else now
        elapsed = now - self._since
        if elapsed < RESIZE_EVERY_S:
            return self.size
        # Weighted by the time since the last look: a claimer that was held up (a retried
        # claim, suspects running alone) does not carry an old rate forward.
        keep = RATE_MEMORY ** (elapsed / RESIZE_EVERY_S)
        with self.lock:
            finished, self._finished = self._finished, 0
            for handle in self.handles.values():
                # The job's items that finished, under this handle or the ones it took over
                # from (their tails still finish in the engine).
                done = 0
                part: JobHandle | None = handle
                while part is not None:
                    done += part.finished
                    part.finished = 0
                    part = part.predecessor
                handle.rate = keep * handle.rate + (1 - keep) * done / elapsed
        self._since = now
        self.rate = keep * self.rate + (1 - keep) * finished / elapsed
        self.size = self._held(self.rate)
        return self.size

    def allowance(self, handle: JobHandle) -> int:
        """The most items of the handle's job the window may hold: `base`, or `lookahead_s`
        of the rate at which its own items finish."""
        return min(self.size, self._held(handle.rate))

    def free(self) -> int:
        return self.size - self.count

    def add(self, handle: JobHandle, n: int, *, finished: bool = False) -> None:
        """`n` items of the handle enter the window (negative: leave it; `finished`: they
        left because the engine finished them, not aborted or refused)."""
        with self.lock:
            self.count += n
            handle.inflight += n
            if finished:
                self._finished -= n
                handle.finished -= n

    def claimable(self) -> list[JobHandle]:
        now = time.monotonic()
        with self.lock:
            return [h for h in self.handles.values() if h.claim_open and h.exhausted_until < now]

    def tenant_full(self, tenant: str, job_id: uuid.UUID, limit: int) -> bool:
        """Whether this tenant already has `limit` other jobs open for claims here (call with
        the lock held)."""
        open_jobs = {
            h.job_id
            for h in self.handles.values()
            if h.tenant == tenant and h.claim_open and h.job_id != job_id
        }
        return len(open_jobs) >= limit

    def close(self, handle: JobHandle) -> None:
        """The task driving the handle ends; a successor may already have taken the job over."""
        with self.lock:
            if self.handles.get(handle.job_id) is handle:
                del self.handles[handle.job_id]

    def jobs(self) -> dict[str, int]:
        """Items in the engine per job, for the worker's stats."""
        with self.lock:
            return {str(j): h.job_inflight() for j, h in self.handles.items()}

    def job_ids(self) -> list[uuid.UUID]:
        with self.lock:
            return list(self.handles)
