"""What Flower shows of a running job, and of a worker.

Flower prints a fixed list of task fields (celery.events.state.Task._fields) on its tasks page,
its task page and its HTTP API (/api/tasks, /api/task/info). A custom field in an event, such as
`done`, is stored on the task but never printed; `result` is in the list. So a running task
sends `task-progress` events whose `result` is the progress, written the way Celery writes a
finished task's result (the repr of a dict): Flower's state machine takes the event's fields
for the custom state PROGRESS, and the final `task-succeeded` event overwrites `result` with the
task's return value, which has the same keys. One shape, before and after the end.

`format_task` (Flower's hook) rewrites tasks for the HTML pages only, and the result backend
only answers /api/task/result: neither reaches /api/tasks, so neither is the mechanism.

Workers: Flower's worker page and /api/workers show the worker's `stats` (the `stats` inspect
command), which merges the `info()` of every worker bootstep; `EngineInfo` adds this worker's
model, engine settings and in-flight item counts there (Flower's "Other" tab).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps

log = logging.getLogger(__name__)

# Flower must show a change within 5 s (the issue); an unchanged count is re-sent at this period
# so that the rate stays current, a changed one at most once a second.
RESEND_S = 4.0
MIN_GAP_S = 1.0


def progress_result(job_id: str, done: int, total: int, items_per_s: float) -> dict[str, Any]:
    """The task's progress in the shape of its final result (tasks.run_job returns the same)."""
    # Progress first: Flower's tasks table cuts a long result off at the column's width.
    return {
        "progress": f"{done}/{total}",
        "items_per_s": round(items_per_s, 2),
        "done": done,
        "total": total,
        "job_id": job_id,
    }


class ProgressReporter:
    """Turns the runner's (done, total) reports into `task-progress` events, throttled."""

    def __init__(
        self,
        job_id: str,
        send: Callable[..., Any],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.job_id = job_id
        self.send = send
        self.clock = clock
        self.started = clock()
        self.first_done: int | None = None
        self.last: tuple[int, int] | None = None
        self.last_at = float("-inf")
        self.latest: dict[str, Any] | None = None

    def rate(self, done: int) -> float:
        """Items finished per second since this task started (its view of the job)."""
        if self.first_done is None:
            self.first_done = done
        elapsed = self.clock() - self.started
        return (done - self.first_done) / elapsed if elapsed > 0 else 0.0

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        self.latest = progress_result(self.job_id, done, total, self.rate(done))
        gap = now - self.last_at
        if gap < MIN_GAP_S or (self.last == (done, total) and gap < RESEND_S):
            return
        self.last, self.last_at = (done, total), now
        try:
            # Celery writes a finished task's result as a repr; so do we, for one shape.
            self.send("task-progress", result=repr(self.latest))
        except Exception as error:  # noqa: BLE001 - progress is best effort
            log.debug("progress not sent: %s", error)

    def final(self, outcome: dict[str, Any]) -> dict[str, Any]:
        """The task's return value: the last progress with the runner's outcome added."""
        base = self.latest or progress_result(self.job_id, 0, 0, 0.0)
        return {**base, **outcome}


class EngineInfo(bootsteps.StartStopStep):
    """Adds `thinkbatch` (model, engine settings, items in flight) to the worker's stats."""

    # Only a StartStopStep joins the list whose info() makes the stats; it starts nothing.
    requires = ("celery.worker.components:Pool",)

    # The stub says info() returns None; Celery merges what it returns into the worker's stats.
    def info(self, parent: Any) -> dict[str, Any]:  # type: ignore[override]
        from worker import lifecycle

        runner = lifecycle.current_runner()
        if runner is None:
            return {"thinkbatch": {"engine": "not loaded"}}
        return {"thinkbatch": runner.describe()}
