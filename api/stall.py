"""A watchdog for each API process's event loop: it logs where the loop is stuck when it has not
run for API_LOOP_STALL_S.

Every connection of a process (receiving bodies, sending responses, answering 408s, the
heartbeat to gunicorn's arbiter) runs on its one event loop; anything that blocks the loop
(a synchronous call on it, or a thread that keeps the interpreter's lock) stops them all at
once, and nothing else in the logs says why. The loop stamps the time a few times a second;
a thread of the watchdog's own reads the stamp and, once it is older than the threshold, logs
the loop thread's stack as it stands then, and again when the loop runs again, with how long
it stood still.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("thinkbatch.api.loop")


class LoopWatchdog:
    def __init__(self, loop: asyncio.AbstractEventLoop, threshold_s: float) -> None:
        self.loop = loop
        self.threshold_s = threshold_s
        self.period_s = min(0.25, threshold_s / 4)
        self.beat = time.monotonic()
        self.loop_thread: int | None = None
        self.stopped = threading.Event()

    def start(self) -> None:
        """Called on the loop's thread, before or while the loop runs."""
        self.loop_thread = threading.get_ident()
        self.loop.call_soon(self._tick)
        threading.Thread(target=self._watch, name="loop-watchdog", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def _tick(self) -> None:
        self.beat = time.monotonic()
        if not self.stopped.is_set():
            self.loop.call_later(self.period_s, self._tick)

    def _watch(self) -> None:
        stalled_since: float | None = None
        while not self.stopped.wait(self.period_s):
            beat = self.beat
            lag = time.monotonic() - beat
            if stalled_since is None and lag > self.threshold_s:
                stalled_since = beat
                log.warning(
                    "the event loop has not run for %.1f s; it stands in:\n%s",
                    lag,
                    self._loop_stack(),
                )
            elif stalled_since is not None and beat > stalled_since:
                log.warning("the event loop ran again after %.1f s", beat - stalled_since)
                stalled_since = None

    def _loop_stack(self) -> str:
        frame = sys._current_frames().get(self.loop_thread or 0)  # noqa: SLF001 - the one way
        if frame is None:
            return "(the loop's thread is gone)"
        return "".join(traceback.format_stack(frame))
