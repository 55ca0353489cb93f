"""The one task: drive a job on this worker's engine."""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from celery import Task
from celery import shared_task

from thinkbatch.queue import RUN_JOB
from worker.lifecycle import get_runner

log = logging.getLogger(__name__)


@shared_task(bind=True, name=RUN_JOB)
def run_job(self: Task, job_id: str) -> dict[str, Any]:
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        log.error("ignoring a task for malformed job id %r", job_id)
        return {"job_id": job_id, "outcome": "malformed"}
    last: list[Any] = [None, 0.0]

    def report(done: int, total: int) -> None:
        # Flower shows this custom state (PROGRESS) with its fields; Postgres stays the truth.
        now = time.monotonic()
        if last[0] == (done, total) and now - last[1] < 10:
            return
        last[0], last[1] = (done, total), now
        meta = {"job_id": job_id, "done": done, "total": total}
        try:
            self.update_state(state="PROGRESS", meta=meta)
            self.send_event("task-progress", **meta)
        except Exception as error:  # noqa: BLE001 - progress is best effort
            log.debug("progress not sent: %s", error)

    return get_runner().drive(key, report)
