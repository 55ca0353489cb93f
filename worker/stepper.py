"""A synchronous engine (vLLM's `LLMEngine`) stepped on a thread of its own, its requests awaited
from the engine loop as asyncio futures.

Why not vLLM's `AsyncLLM`: it spends an asyncio task, an output queue and several event-loop
turns on every request, on the worker's one GIL. `LLMEngine`, the engine `vllm.LLM` runs, takes
the same requests in a plain loop; here a request costs a future, a place in a list and its
share of one hand-off per engine step. What it bought the worker, measured by `make bench`
before and after: docs/performance.md.

One thread owns the engine: it adds the requests handed in, aborts the ones given up, steps
the engine while it has work, and hands every finished output back to the loop in one call per
step. Nothing here imports vLLM: the adapter passes the engine and says how to add a request
and what an error means (`classify`), so fast tests drive this with an engine of their own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any
from typing import Protocol

from worker.engine import EngineDead

log = logging.getLogger(__name__)


class SyncEngine(Protocol):
    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[Any]: ...

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None: ...


# A finished request's output, or the error its future is to raise.
_Settled = list[tuple["asyncio.Future[Any]", Any, bool]]


def _settle(settled: _Settled) -> None:
    """On the loop: resolve the futures of one step (a future given up on is done already)."""
    for future, value, failed in settled:
        if future.done():
            continue
        if failed:
            future.set_exception(value)
        else:
            future.set_result(value)


class Stepper:
    """`add(engine, request_id, payload)` adds one request to the engine (raising what vLLM
    raises for it); `classify(error, payload)` turns an error into the one its item gets (the
    payload is None for an error of the step): an `EngineDead` ends the engine for every
    request, anything else fails that request alone."""

    def __init__(
        self,
        engine: SyncEngine,
        *,
        add: Callable[[Any, str, Any], None],
        classify: Callable[[BaseException, Any], BaseException],
        name: str = "engine-step",
    ) -> None:
        self.engine = engine
        self._add = add
        self._classify = classify
        self._lock = threading.Lock()
        self._wake = threading.Event()
        # Handed in from the loop, taken by the stepping thread at its next turn.
        self._inbox: list[tuple[str, Any, asyncio.Future[Any]]] = []
        self._aborts: list[str] = []
        # Requests in the engine, by id; touched by the stepping thread only.
        self._running: dict[str, asyncio.Future[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: EngineDead | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- on the loop ----------------------------------------------------------------------------

    async def run(self, request_id: str, payload: Any) -> Any:
        """The request's final output. Cancelled, it is aborted in the engine."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self._loop = loop
            self._inbox.append((request_id, payload, future))
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            with self._lock:
                self._aborts.append(request_id)
            self._wake.set()
            raise

    # --- from any thread ------------------------------------------------------------------------

    def fail(self, error: EngineDead, taken: list[asyncio.Future[Any]] | None = None) -> None:
        """The engine is gone (its process died; see the adapter's watch): every request
        waiting on it, and every later one, gets `error`. The stepping thread may be blocked
        in the engine for good; it is a daemon and the worker restarts. `taken`: requests the
        stepping thread had taken from the inbox but not yet added."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
            waiting = [future for _, _, future in self._inbox] + (taken or [])
            self._inbox = []
        # The stepping thread may be changing this dict: list() copies it without running any
        # Python code, so under the GIL the copy is whole.
        waiting.extend(list(self._running.values()))
        self._hand_back([(future, error, True) for future in waiting])

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def dead(self) -> EngineDead | None:
        return self._dead

    # --- the stepping thread --------------------------------------------------------------------

    def _hand_back(self, settled: _Settled) -> None:
        loop = self._loop
        if settled and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # the loop closed in between: nobody awaits these
                pass

    def _run(self) -> None:
        engine = self.engine
        busy = False
        while not self._stopping and self._dead is None:
            if not busy:
                self._wake.wait()
            self._wake.clear()
            with self._lock:
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
            settled: _Settled = []
            try:
                # Aborts first: a request given up before it was added is skipped below.
                gone = [rid for rid in aborts if self._running.pop(rid, None) is not None]
                if gone:
                    engine.abort_request(gone)
                for request_id, payload, future in inbox:
                    if future.cancelled():
                        continue
                    try:
                        self._add(engine, request_id, payload)
                    except Exception as error:  # classified: the item's fault or the engine's
                        refusal = self._classify(error, payload)
                        if isinstance(refusal, EngineDead):
                            raise refusal from error
                        settled.append((future, refusal, True))
                        continue
                    self._running[request_id] = future
                busy = engine.has_unfinished_requests()
                if busy:
                    for output in engine.step():
                        if output.finished:
                            waiter = self._running.pop(output.request_id, None)
                            if waiter is not None:
                                settled.append((waiter, output, False))
            except BaseException as error:  # the engine is gone for every request
                dead = self._classify(error, None)
                if not isinstance(dead, EngineDead):
                    log.exception("the engine failed while stepping")
                    dead = EngineDead(f"the engine failed while stepping: {error!r}")
                self._hand_back(settled)
                self.fail(dead, [future for _, _, future in inbox])
                return
            self._hand_back(settled)
