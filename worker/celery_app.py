"""Celery entry point of a GPU worker:

    celery -A worker.celery_app worker -E -l INFO

One process per GPU (or engine): a threads pool, never prefork, because the process must not
fork once vLLM and CUDA are loaded. The engine is created once, before the worker consumes.
"""

from __future__ import annotations

from celery import signals
from kombu import Queue

from thinkbatch import logging_setup
from thinkbatch.queue import make_celery
from thinkbatch.queue import model_queue
from thinkbatch.settings import get_settings

settings = get_settings()
app = make_celery(settings)
app.conf.update(
    worker_pool="threads",
    worker_concurrency=settings.worker_concurrency,
    # The queues of the names it serves, its base model's and its adapters': hints of the jobs
    # of those models come there (thinkbatch/queue.py). Flower shows each.
    task_queues=[Queue(model_queue(settings, name)) for name in settings.served_names],
    # Each worker also consumes its own queue: an idle worker sends itself hints there.
    worker_direct=True,
    include=["worker.tasks"],
)


@signals.setup_logging.connect
def _configure_logging(**_: object) -> None:
    # Ours instead of Celery's: JSON lines with job and item ids (thinkbatch.logging_setup).
    logging_setup.configure(settings, "worker")


from worker import lifecycle  # noqa: E402,F401 - connects the worker signals
from worker.progress import EngineInfo  # noqa: E402

# Model, engine settings and in-flight counts in the worker's stats (Flower's worker page).
app.steps["worker"].add(EngineInfo)
