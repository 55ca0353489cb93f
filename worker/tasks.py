"""The one task: drive a job on this worker's engine."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import Task
from celery import shared_task

from thinkbatch.logging_setup import bind
from thinkbatch.queue import RUN_JOB
from worker.lifecycle import get_runner
from worker.progress import ProgressReporter

log = logging.getLogger(__name__)


# Results are kept (for RESULT_EXPIRES, a day): Flower's /api/task/result then reports the
# final counts instead of PROGRESS forever. Postgres stays the truth; these are a display.
@shared_task(bind=True, name=RUN_JOB, ignore_result=False)
def run_job(self: Task[Any, Any], job_id: str) -> dict[str, Any]:
    try:
        key = uuid.UUID(job_id)
    except ValueError:
        log.error("ignoring a task for malformed job id %r", job_id)
        return {"job_id": job_id, "outcome": "malformed"}

    def send(event: str, result: str) -> None:
        self.send_event(event, result=result)
        # The backend's copy answers /api/task/result while the task runs.
        self.update_state(state="PROGRESS", meta=reporter.latest)

    reporter = ProgressReporter(job_id, send)
    with bind(job_id=job_id):
        log.info("driving the job")
        result = reporter.final(get_runner().drive(key, reporter))
        log.info("task ends at %s of the job's items", result.get("progress", "?"))
    return result
