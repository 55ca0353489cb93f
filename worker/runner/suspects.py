"""Crash suspects: items that were in the engine when it (or its worker) died. The ledger
releases them with crashes + 1 and hands them out in groups (ledger.claim, suspects=True);
this object is the runner's side: which jobs have suspects waiting, and how many suspects run
alone in a drained engine now (nothing else is claimed meanwhile, so a crash among them
charges them and no bystander)."""

from __future__ import annotations

import threading

from worker.runner.window import JobHandle


class Suspects:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: set[JobHandle] = set()
        self._running = 0

    def flag(self, handle: JobHandle, waiting: bool) -> None:
        """Record whether the job has suspects waiting to run."""
        with self._lock:
            if waiting:
                self._waiting.add(handle)
            else:
                self._waiting.discard(handle)

    def waiting(self, handles: list[JobHandle]) -> list[JobHandle]:
        """The handles, of those given, whose job has suspects waiting."""
        with self._lock:
            return [h for h in handles if h in self._waiting]

    def has_waiting(self, handle: JobHandle) -> bool:
        with self._lock:
            return handle in self._waiting

    def entered(self, n: int) -> None:
        """`n` suspects went into the engine, alone."""
        with self._lock:
            self._running += n

    def left(self, n: int) -> None:
        """`n` suspects' outcomes were stored."""
        if n:
            with self._lock:
                self._running -= n

    @property
    def running(self) -> bool:
        """Suspects run alone in the engine now: claim nothing else."""
        return self._running > 0
