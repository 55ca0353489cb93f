"""CPU time per stage of an item's way through the worker process, measured where it is spent.

Each stage adds the thread CPU time (`time.thread_time`) its code took on the thread that ran it,
so time a thread spends waiting (on Postgres, the GIL, the engine) is not counted. A clock read
costs a system call (1-2 us in a VM), so the per-batch stages are timed on every batch and the
per-item stages on the engine loop on one item in `SAMPLE_EVERY`, counted `SAMPLE_EVERY` times:
cheap enough to stay on in production. The totals are served as
`thinkbatch_worker_stage_cpu_seconds_total{stage}` beside each thread's own CPU total, and
`make bench` prints them per item.

Stages, in the item's order: `claim` (the leasing transaction, claimer thread), `prepare`
(render the chat template and tokenize), `launch` (sampling, the flights, the hand-off to the
loop), `submit` (creating the task and the engine's first step for the request, on the engine
loop), `output` (the request's later steps: taking its final output, decoding the text),
`settle` (back in the window, queued for the writer), `parse` (splitting thinking from the
answer, counting reasoning tokens; writer thread), `store` (the fenced write transaction).
What the engine loop spends beside these (vLLM's output handler for all requests, or the fake
engine's steps, and asyncio itself) is its thread's total minus them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Coroutine
from collections.abc import Generator
from collections.abc import Iterable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

STAGES = ("claim", "prepare", "launch", "submit", "output", "settle", "parse", "store")
# One item in this many has its per-item stages timed (the others cost nothing to account).
SAMPLE_EVERY = 16


class StageClock:
    """CPU seconds by stage: the worker's STAGES unless others are named; a stage not named
    up front is counted from its first use (bench/request_stages.py names none)."""

    def __init__(self, stages: Iterable[str] = STAGES) -> None:
        self._lock = threading.Lock()
        self._cpu = dict.fromkeys(stages, 0.0)

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._cpu[stage] = self._cpu.get(stage, 0.0) + seconds

    @contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        start = time.thread_time()
        try:
            yield
        finally:
            self.add(stage, time.thread_time() - start)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._cpu)


clock = StageClock()


class Timed:
    """Awaits a coroutine, charging the CPU of its first step to `first` and of every later
    step to `rest`, `weight` times (a sample standing for that many). Each step runs
    synchronously on the loop's thread, so the thread's CPU between a step's start and end is
    that coroutine's alone; the suspensions in between (other tasks' turns) are not counted.
    Cancellation and errors pass through as with `await`."""

    __slots__ = ("clock", "coroutine", "first", "rest", "weight")

    def __init__(
        self,
        coroutine: Coroutine[Any, Any, Any],
        first: str,
        rest: str,
        on: StageClock = clock,
        weight: int = 1,
    ) -> None:
        self.coroutine = coroutine
        self.first = first
        self.rest = rest
        self.clock = on
        self.weight = weight

    def __await__(self) -> Generator[Any, Any, Any]:
        coroutine, stage, weight = self.coroutine, self.first, self.weight
        value: Any = None
        error: BaseException | None = None
        while True:
            start = time.thread_time()
            try:
                signal = coroutine.send(value) if error is None else coroutine.throw(error)
            except StopIteration as stop:
                self.clock.add(stage, (time.thread_time() - start) * weight)
                return stop.value
            except BaseException:
                self.clock.add(stage, (time.thread_time() - start) * weight)
                raise
            self.clock.add(stage, (time.thread_time() - start) * weight)
            stage = self.rest
            try:
                value, error = (yield signal), None
            except GeneratorExit:
                coroutine.close()
                raise
            except BaseException as raised:  # noqa: BLE001 - handed to the coroutine, as await does
                value, error = None, raised


_NUMBERED = re.compile(r"[-_ ]?\d+(?:_\d+)?$")


def thread_cpu() -> dict[str, float]:
    """CPU seconds of each live Python thread of this process, by name (numbered threads of
    one pool summed). Threads Python did not start (vLLM's and torch's) are not listed: they
    are the process's total less these."""
    out: dict[str, float] = {}
    for thread in threading.enumerate():
        if thread.ident is None:
            continue
        try:
            seconds = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (OSError, ValueError):  # the thread ended in between
            continue
        name = _NUMBERED.sub("", thread.name) or thread.name
        out[name] = out.get(name, 0.0) + seconds
    return out
