"""The Celery app both sides share, and the one message it carries: "job X has work".

A message holds a job id and nothing else. It is a hint: Postgres decides what runs. Losing one
is repaired by the sweeper; receiving one twice is harmless because claims are fenced. Hints go
to one queue per served model (`model_queue`), which the workers of that model consume; one on
the wrong queue claims nothing, since a worker claims only the items of the models it serves.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from celery import Celery

from thinkbatch.settings import Settings

RUN_JOB = "thinkbatch.run_job"

log = logging.getLogger(__name__)


def make_celery(settings: Settings) -> Celery:
    app = Celery("thinkbatch", broker=settings.require_redis_url())
    transport = {
        "visibility_timeout": settings.visibility_timeout_s,
        # Fail fast when Redis is away: the API stores the job and the sweeper enqueues later.
        "socket_connect_timeout": 3,
        "socket_timeout": 10,
        "health_check_interval": 10,
    }
    app.conf.update(
        result_backend=settings.require_redis_url(),
        result_backend_transport_options=transport,
        result_expires=86400,
        broker_transport_options=transport,
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=3,
        task_default_queue=settings.queue_name,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        # Postgres holds outcomes; the result backend only carries progress for Flower.
        task_ignore_result=True,
        task_track_started=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        # Acknowledge a hint when its task starts. Postgres knows every unfinished item and the
        # sweeper re-enqueues any job whose hint is lost, so late acks would add nothing but
        # (a) duplicate redeliveries after the visibility timeout and (b) kombu 5.7 killing the
        # worker when Redis drops while a message is unacked (seen here: AttributeError in
        # restore_unacked_once, "Unrecoverable error"). One message reserved per free thread.
        task_acks_late=False,
        worker_prefetch_multiplier=1,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5},
    )
    return app


def model_queue(settings: Settings, model: str) -> str:
    """The Celery queue of one served name (a base model or an adapter): the workers that serve
    it consume it, and a job's hints go to the queues of its models."""
    return f"{settings.queue_name}.{model}"


def publish_job(app: Celery, job_id: uuid.UUID, *, copies: int = 1, queue: Any = None) -> bool:
    """Enqueue `copies` hints for a job (on `queue`: a model's, or a worker's own); False
    (logged) when Redis cannot be reached."""
    try:
        for _ in range(copies):
            app.send_task(RUN_JOB, args=[str(job_id)], queue=queue)
    except Exception as error:  # noqa: BLE001 - any broker failure means "sweeper retries later"
        log.warning("could not enqueue job %s: %s", job_id, error)
        return False
    return True
