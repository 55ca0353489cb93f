"""Worker process life cycle: load the engine once before consuming, shut it down on exit, and
never leave an engine process behind.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
import uuid
from typing import Any

import psutil
from celery import signals
from celery.utils.nodenames import worker_direct

from thinkbatch import ledger
from thinkbatch.db import make_engine
from thinkbatch.db import reads
from thinkbatch.queue import model_queue
from thinkbatch.queue import publish_job
from thinkbatch.settings import Settings
from thinkbatch.settings import get_settings
from worker import metrics as worker_metrics
from worker.engine import create_engine
from worker.reaper import spawn_reaper
from worker.reaper import watch_processes
from worker.runner import EXIT_SHUTDOWN_TIMEOUT
from worker.runner import Runner
from worker.runner import check_served_names

log = logging.getLogger(__name__)

_runner: Runner | None = None
_reaper: Any = None


def get_runner() -> Runner:
    if _runner is None:
        raise RuntimeError("the engine is not loaded in this process")
    return _runner


def current_runner() -> Runner | None:
    """The runner if the engine is loaded (for the worker's stats), else None."""
    return _runner


@signals.worker_init.connect
def load_engine(sender: Any = None, **_: Any) -> None:
    global _runner, _reaper
    settings = get_settings()  # the one worker/celery_app.py built
    celery = sender.app  # and its Celery app: hints are sent through the worker's own
    own_queue = worker_direct(sender.hostname)
    try:
        db = make_engine(settings)
        check_served_names(settings, db)

        def publish(job_id: uuid.UUID) -> bool:
            """Hints for a job on the queues of its models (a slice handed on, a lost hint)."""
            with reads(db).connect() as conn:
                models = ledger.job_models(conn, job_id)
            return all(publish_job(celery, job_id, queue=model_queue(settings, m)) for m in models)

        runner = Runner(
            settings,
            engine=create_engine(settings),
            db=db,
            publish=publish,
            publish_here=lambda job_id: publish_job(celery, job_id, queue=own_queue),
        )
        _reaper, write_end = spawn_reaper()
        runner.start()
        worker_metrics.serve(settings, runner)
        watched = watch_processes(write_end, exclude={_reaper.pid})
        log.info("engine processes under the reaper's watch: %s", watched)
    except Exception as error:
        # Fail fast: a worker without an engine must not consume (and drop) job messages.
        if isinstance(error, ledger.ServedNameTaken):
            log.error("refusing to start, served names taken: %s", error)
        else:
            log.exception("could not start the engine")
        _kill_children(exclude=None)  # an engine that did start must not outlive us
        logging.shutdown()
        os._exit(2)
    _runner = runner


@signals.worker_ready.connect
def freeze_heap(**_: Any) -> None:
    """Move everything start-up made (vLLM, torch, the tokenizer, Celery: 712,000 objects in
    the demo worker) out of the garbage collector's reach, as `vllm serve` does after its
    start-up. Otherwise every full collection walks them all, and the per-item work of
    claiming, rendering and decoding allocates enough to trigger one every few hundred items:
    with only transformers loaded, one cost 0.2 s of CPU, and in `make bench` a render or a
    tokenize cost 3-6 times its isolated price."""
    if _runner is None:
        return
    gc.collect()
    gc.freeze()
    log.info("garbage collector: %d start-up objects frozen", gc.get_freeze_count())


@signals.worker_shutting_down.connect
def stop_claiming(**_: Any) -> None:
    if _runner is None:
        return
    _runner.begin_shutdown()
    threading.Thread(target=_watchdog, args=(_runner.settings,), daemon=True).start()


@signals.worker_shutdown.connect
def unload_engine(**_: Any) -> None:
    if _runner is not None:
        _runner.close()


def _watchdog(settings: Settings) -> None:
    """Bound the shutdown: after SHUTDOWN_TIMEOUT_S, kill the engine processes and exit."""
    time.sleep(settings.shutdown_timeout_s)
    log.error("shutdown took longer than %ss; exiting hard", settings.shutdown_timeout_s)
    _kill_children(exclude=_reaper.pid if _reaper is not None else None)
    logging.shutdown()
    os._exit(EXIT_SHUTDOWN_TIMEOUT)


def _kill_children(exclude: int | None) -> None:
    for child in psutil.Process().children(recursive=True):
        if child.pid != exclude:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
