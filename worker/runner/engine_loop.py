"""The engine loop: an asyncio loop on a thread of its own that runs `engine.generate` for
every item in flight, aborts items on cancel, expiry, deadline or shutdown, and hands each
result to the writer."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from collections.abc import Coroutine
from typing import Any

from worker.engine import Engine
from worker.engine import EngineDead
from worker.engine import ItemRejected
from worker.metrics import metrics
from worker.runner.window import AbortReason
from worker.runner.window import Flight
from worker.runner.window import InFlight
from worker.runner.writer import Outcome
from worker.runner.writer import OutcomeKind
from worker.runner.writer import Writer
from worker.stages import SAMPLE_EVERY
from worker.stages import Timed
from worker.stages import clock

log = logging.getLogger(__name__)


def _started_before(limit: float, flight: Flight) -> bool:
    return flight.started < limit


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        inflight: InFlight,
        writer: Writer,
        *,
        item_deadline_s: float,
        on_death: Callable[[BaseException], None],
    ) -> None:
        self.engine = engine
        self.inflight = inflight
        self.writer = writer
        self.item_deadline_s = item_deadline_s
        self.on_death = on_death
        self.loop = asyncio.new_event_loop()
        self._flights: set[Flight] = set()  # touched on the loop's thread only
        self._launched = 0  # flights so far: every SAMPLE_EVERY-th has its stages timed
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="engine-loop", daemon=True
        )

    # --- from other threads -----------------------------------------------------------------

    def start(self) -> None:
        """Start the loop and the engine on it; returns once the engine is up."""
        self.thread.start()
        self.call(self.engine.start()).result()
        asyncio.run_coroutine_threadsafe(self._watch_deadlines(), self.loop)

    def call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the loop; returns its concurrent future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def launch(self, flights: list[Flight]) -> None:
        self.loop.call_soon_threadsafe(self._launch, flights)

    def abort(self, predicate: Callable[[Flight], bool], reason: AbortReason) -> None:
        """Abort the flights the predicate picks (safe from any thread, and a signal handler)."""
        self.loop.call_soon_threadsafe(self._abort_where, predicate, reason)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)

    # --- on the loop ----------------------------------------------------------------------------

    def _launch(self, flights: list[Flight]) -> None:
        start = time.thread_time()
        for flight in flights:
            self._flights.add(flight)
            self._launched += 1
            flight.sampled = self._launched % SAMPLE_EVERY == 0
            flight.task = self.loop.create_task(self._run(flight))
            flight.task.add_done_callback(functools.partial(self._unstarted, flight))
        clock.add("submit", time.thread_time() - start)

    def _unstarted(self, flight: Flight, _task: object = None) -> None:
        """A task cancelled before its first step never enters _run's handlers: settle its
        item here, or it would stay in flight (and `running`) for good."""
        if flight in self._flights:
            self._settle(flight, self._aborted(flight))

    @staticmethod
    def _aborted(flight: Flight) -> Outcome:
        # Cancelled by anything but _abort_where (the loop closing): hand it back untouched.
        reason = flight.abort_reason or AbortReason.shutdown
        return Outcome(flight, flight.claimed, flight.handle, OutcomeKind.aborted, reason=reason)

    async def _run(self, flight: Flight) -> None:
        item = flight.claimed
        request_id = f"{item.id}-{item.attempt}"
        try:
            request = self.engine.generate(request_id, flight.prepared)
            if flight.sampled:
                # The request's first step (into the engine) is `submit`; its later ones
                # (taking its output, decoding it) are `output`.
                generation = await Timed(request, "submit", "output", weight=SAMPLE_EVERY)
            else:
                generation = await request
            outcome = Outcome(flight, item, flight.handle, OutcomeKind.done, generation=generation)
        except asyncio.CancelledError:
            outcome = self._aborted(flight)
        except EngineDead as error:
            self._flights.discard(flight)
            self.on_death(error)
            return
        except ItemRejected as error:
            outcome = Outcome(
                flight, item, flight.handle, OutcomeKind.rejected,
                code=error.code, message=error.message,
            )  # fmt: skip
        except Exception as error:  # noqa: BLE001 - an unexpected per-item failure is retried
            log.warning(
                "item %s failed in the engine: %s",
                item.id,
                type(error).__name__,
                extra={"job_id": str(item.job_id), "item_id": item.id},
            )
            outcome = Outcome(
                flight, item, flight.handle, OutcomeKind.error,
                code="engine_error", message=repr(error),
            )  # fmt: skip
        self._settle(flight, outcome)

    def _settle(self, flight: Flight, outcome: Outcome) -> None:
        start = time.thread_time() if flight.sampled else 0.0
        self._flights.discard(flight)
        engine_s = time.monotonic() - flight.started
        created = flight.handle.created_at
        queued_s = time.time() - engine_s - created if created else None
        metrics.left_engine(outcome.kind, engine_s, queued_s)
        # Only what the engine finished tells how fast it goes: a burst of aborts (a cancel,
        # a deadline) would otherwise read as speed and grow the window.
        self.inflight.add(flight.handle, -1, finished=outcome.kind is OutcomeKind.done)
        self.writer.put(outcome)
        self.inflight.wake.set()
        if flight.sampled:
            clock.add("settle", (time.thread_time() - start) * SAMPLE_EVERY)

    def _abort_where(self, predicate: Callable[[Flight], bool], reason: AbortReason) -> None:
        for flight in list(self._flights):
            if flight.abort_reason is None and predicate(flight) and flight.task is not None:
                flight.abort_reason = reason
                flight.task.cancel()

    async def _watch_deadlines(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            limit = time.monotonic() - self.item_deadline_s
            self._abort_where(functools.partial(_started_before, limit), AbortReason.deadline)
