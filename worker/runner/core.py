"""The runner: one engine per worker process, kept full across jobs, with results persisted
in batches. `Runner` wires the parts together and keeps the life cycle (start, close) and the
driving of a job; each part has one concern:

* window.py: the shared in-flight window (job handles, counts, and the one lock);
* fairness.py: fair share between jobs and tenants, as pure functions;
* claimer.py: leases, renders, tokenizes and launches items (thread "claimer"), with
  suspects.py keeping the crash suspects that run alone;
* engine_loop.py: the asyncio loop running every item in the engine (thread "engine-loop");
* writer.py: stores outcomes in batches, off the engine's path (thread "writer");
* housekeeping.py: heartbeat, the recovery sweep, and an idle worker's pull ("housekeeper").

Celery task threads call `drive`: one per job being driven; each reports progress, watches
for cancel and expiry, and returns once its items are settled.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.db import reads
from thinkbatch.db import retry_transient
from thinkbatch.ledger import ModelFilter
from thinkbatch.models import JobStatus
from thinkbatch.settings import Settings
from worker.engine import Engine
from worker.engine import ModelShape
from worker.runner.claimer import Claimer
from worker.runner.engine_loop import EngineLoop
from worker.runner.housekeeping import Housekeeper
from worker.runner.housekeeping import yield_cpu
from worker.runner.suspects import Suspects
from worker.runner.window import AbortReason
from worker.runner.window import InFlight
from worker.runner.window import JobHandle
from worker.runner.writer import Writer

log = logging.getLogger(__name__)


def check_served_names(settings: Settings, db: sa.Engine) -> None:
    """Raise ServedNameTaken if live workers of another base model serve a name this worker
    would. Registration checks again, atomically; this check comes before the engine loads,
    which takes minutes for a large model that registration would then refuse."""

    def read() -> list[ledger.NameClash]:
        with reads(db).connect() as conn:
            return ledger.name_clashes(
                conn,
                settings.model_name,
                list(settings.lora_adapters),
                dead_after_s=settings.worker_dead_after_s,
            )

    clashes = retry_transient(read, attempts=30)
    if clashes:
        raise ledger.ServedNameTaken(clashes)


EXIT_ENGINE_DEAD = 3
# A served name of this worker's is another base model's: the exit of a worker refused at start
# (worker/lifecycle.py), so that a supervisor treats both alike.
EXIT_NAMES_TAKEN = 2
EXIT_SHUTDOWN_TIMEOUT = 4
PROGRESS_INTERVAL_S = 1.0


class Runner:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        db: sa.Engine,
        publish: Callable[[uuid.UUID], bool],
        publish_here: Callable[[uuid.UUID], bool] | None = None,
        exit_process: Callable[[int], None] = os._exit,  # a test's stands in for it
    ):
        self.settings = settings
        self._exit = exit_process
        self.engine = engine
        self.db = db
        self.publish = publish  # a hint any worker may take
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.window = settings.inflight_window
        self.stopping = threading.Event()
        self._dead = threading.Event()
        # Set once the runner is closed: its housekeeper (which beats until then: our leases
        # stand until we release them) ends, and close() waits for every thread it started.
        self._closed = threading.Event()
        self.inflight = InFlight(
            self.window,
            most=settings.inflight_window_most,
            lookahead_s=settings.inflight_lookahead_s,
        )
        self.suspects = Suspects()
        # A job finished (by a store): wakes the housekeeper to make a batch's output files.
        self._finished = threading.Event()
        self.writer = Writer(
            settings,
            db,
            self.owner,
            engine,
            self.inflight,
            self.suspects,
            self._dead,
            finished=self._finished,
        )
        self.engine_loop = EngineLoop(
            engine,
            self.inflight,
            self.writer,
            item_deadline_s=settings.item_deadline_s,
            on_death=self._engine_died,
        )
        self.claimer = Claimer(
            settings,
            engine,
            db,
            self.owner,
            inflight=self.inflight,
            suspects=self.suspects,
            engine_loop=self.engine_loop,
            writer=self.writer,
            stopping=self.stopping,
        )
        self.housekeeper = Housekeeper(
            settings,
            db,
            self.owner,
            inflight=self.inflight,
            suspects=self.suspects,
            publish=publish,
            publish_here=publish_here,
            stopping=self.stopping,
            dead=self._dead,
            finished=self._finished,
            closed=self._closed,
            names_taken=self._names_taken,
        )
        self._threads: list[threading.Thread] = []

    @property
    def items_in_engine(self) -> int:
        """Items in the engine now (or held for it), for the metrics."""
        return self.inflight.count

    def describe(self) -> dict[str, Any]:
        """Model, engine settings and load, for the worker's stats (Flower) and metrics."""
        s = self.settings
        return {
            "owner": self.owner,
            "model": s.model_name,
            "adapters": list(s.lora_adapters),
            "engine": s.engine,
            "max_num_seqs": s.max_num_seqs,
            "max_model_len": s.max_model_len,
            "dtype": s.dtype,
            "tensor_parallel_size": s.tensor_parallel_size,
            "window": self.inflight.size,  # now; it moves between these two
            "window_range": [self.inflight.base, self.inflight.most],
            "items_in_engine": self.items_in_engine,
            "jobs_in_flight": self.inflight.jobs(),
        }

    # --- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.engine_loop.start()
        # Register once the engine is up and the heartbeat is about to start: a row registered
        # before a load that takes minutes would be judged dead by the other workers.
        self._register_worker()
        for target, name in (
            (self.claimer.run, "claimer"),
            (self.writer.run, "writer"),
            (self.housekeeper.run, "housekeeper"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info(
            "runner %s ready: window=%d items (up to %d while the engine finishes items fast)",
            self.owner,
            self.window,
            self.inflight.most,
        )

    def begin_shutdown(self) -> None:
        """Stop claiming and hand back what is in flight. Safe to call from a signal handler."""
        if self.stopping.is_set():
            return
        log.warning("shutting down: releasing %d in-flight item(s)", self.inflight.count)
        self.stopping.set()
        self.inflight.wake.set()
        self.engine_loop.abort(lambda f: True, AbortReason.shutdown)

    def close(self, timeout: float | None = None) -> None:
        """Wait for the writer to store what it holds, then stop the engine."""
        self.begin_shutdown()
        deadline = time.monotonic() + (timeout or self.settings.shutdown_timeout_s)
        while time.monotonic() < deadline and (self.inflight.count or not self.writer.idle()):
            time.sleep(0.05)
        self.writer.finish()
        self.claimer.close()
        for thread in self._threads:
            if thread.name == "writer":
                thread.join(max(0.0, deadline - time.monotonic()))
        try:
            future = self.engine_loop.call(self.engine.shutdown())
            future.result(max(1.0, deadline - time.monotonic()))
        except Exception:  # the process exits next; the reaper cleans up
            log.exception("engine shutdown failed")
        self.engine_loop.stop()
        self._closed.set()
        self._finished.set()  # wakes the housekeeper, which then sees it is closed
        for thread in self._threads:
            thread.join(max(0.1, deadline - time.monotonic()))
        try:
            with self.db.begin() as conn:
                ledger.mark_stopped(conn, self.owner)
        except Exception:  # noqa: BLE001 - best effort; the heartbeat lapses anyway
            log.warning("could not mark worker %s stopped", self.owner)

    def _register_worker(self) -> None:
        try:
            shape: ModelShape | None = self.engine.shape()
        except Exception:  # the API then checks no bound for this model
            log.exception("could not measure the model's shape")
            shape = None

        def register() -> None:
            with self.db.begin() as conn:
                ledger.register_worker(
                    conn,
                    self.owner,
                    hostname=socket.gethostname(),
                    pid=os.getpid(),
                    model=self.settings.model_name,
                    adapters=list(self.settings.lora_adapters),
                    max_model_len=shape.max_model_len if shape else None,
                    token_bytes_max=shape.token_bytes_max if shape else None,
                    message_tokens_min=shape.message_tokens_min if shape else None,
                    dead_after_s=self.settings.worker_dead_after_s,
                )

        retry_transient(register, attempts=30)

    # --- driving a job (Celery task threads) -----------------------------------------------

    def drive(self, job_id: uuid.UUID, report: Callable[[int, int], None]) -> dict[str, Any]:
        """Drive one job: claim its items until the slice ends or none are left, report
        progress, and return once everything this task claimed is stored."""
        yield_cpu()
        handle = self._attach(job_id)
        if handle is None:
            return {"job_id": str(job_id), "outcome": "not runnable here"}
        slice_end = time.monotonic() + self.settings.task_slice_s
        next_beat = 0.0
        state = None
        handed_off = False
        others_only = False  # what is left pending is other models' items
        try:
            while True:
                handle.settled.wait(PROGRESS_INTERVAL_S)
                handle.settled.clear()
                # Read before the job's state: if nothing of ours was unsettled then, the state
                # includes every result we stored, so the report made from it is final.
                all_settled = handle.unsettled == 0
                now = time.monotonic()
                # Postgres may restart under us: keep retrying rather than drop the job.
                if now >= next_beat:
                    state = retry_transient(
                        lambda: self._heartbeat_job(job_id), should_stop=self._dead.is_set
                    )
                    next_beat = now + self.settings.heartbeat_s
                else:
                    state = retry_transient(
                        lambda: self._job_state(job_id), should_stop=self._dead.is_set
                    )
                if state is None:
                    break
                report(state.done, state.total)
                if state.status in (JobStatus.cancelling, JobStatus.cancelled) or state.expired:
                    reason = AbortReason.expired if state.expired else AbortReason.cancelled
                    handle.claim_open = False
                    self.engine_loop.abort(lambda f: f.handle is handle, reason)
                    if state.expired:
                        retry_transient(lambda: self._expire(job_id), should_stop=self._dead.is_set)
                elif state.status not in ledger.RUNNABLE:
                    handle.claim_open = False
                if self.stopping.is_set():
                    handle.claim_open = False
                elif now >= slice_end and handle.claim_open:
                    handle.claim_open = False
                    if state.pending > 0 and state.status in ledger.RUNNABLE:
                        # Hand the job on now, while our tail is still in the engine: the next
                        # task (here or on another worker) claims before the window drains.
                        handed_off = self.publish(job_id)
                if all_settled:
                    if not handle.claim_open:
                        break
                    if handle.exhausted_until and state.pending == 0:
                        break
                    if state.pending > 0 and handle.exhausted_until:
                        if not self._pending_here(handle):
                            # Every pending item is another model's: their workers run them,
                            # or the job waits for one. Driving on would claim nothing, hold a
                            # task thread and keep the job looking alive to the sweeper.
                            others_only = True
                            break
                        handle.exhausted_until = 0.0  # items came back (released); claim again
                        self.inflight.wake.set()
        finally:
            self.inflight.close(handle)
            self.suspects.flag(handle, False)
        pending = state.pending if state is not None else 0
        runnable = state is not None and state.status in ledger.RUNNABLE
        if pending and runnable and not handed_off and not others_only:
            # Items are left that nobody was told about: released on shutdown, or returned by
            # a crash or a retry after claiming closed.
            self.publish(job_id)
        return {"job_id": str(job_id), "done": state.done if state else 0, "pending": pending}

    def _attach(self, job_id: uuid.UUID) -> JobHandle | None:
        with self._reads.connect() as conn:
            row = ledger.job_to_drive(conn, job_id)
        if row is None or row.status not in ledger.RUNNABLE:
            return None
        # Only the items of the models this worker serves: a hint for a job of other models
        # (sent to the wrong queue, or by hand) claims nothing here, and the job waits for its
        # own workers. Postgres's model per item is what decides, never the queue.
        models = ModelFilter.of(row.model, row.models or [row.model], self.settings.served_names)
        if not models.names:
            log.info("job %s has no items of the models served here; hint dropped", job_id)
            return None
        with self.inflight.lock:
            current = self.inflight.handles.get(job_id)
            if (current is not None and current.claim_open) or self.stopping.is_set():
                return None  # another task of this process already drives it
            if self.inflight.tenant_full(
                row.tenant, job_id, self.settings.tenant_max_jobs_per_worker
            ):
                # Task threads are shared by all tenants: one with many jobs may not hold them
                # all. The job keeps its pending items; the sweeper re-hints it (HINT_STALE_S)
                # and an idle worker pulls it, by when a slot of its tenant may be free.
                log.info("job %s waits: its tenant has as many jobs here as it may", job_id)
                return None
            # A predecessor whose slice ended keeps its flights (they point at its handle) and
            # returns once they are stored; claiming for the job continues under this handle.
            handle = JobHandle(
                job_id=job_id,
                weight=1 + row.priority,
                params=row.params or {},
                models=models,
                tenant=row.tenant,
                created_at=row.created_at.timestamp(),
                predecessor=current,
                rate=current.rate if current is not None else 0.0,  # the same job's items
            )
            self.inflight.handles[job_id] = handle
        self.inflight.wake.set()
        return handle

    def _pending_here(self, handle: JobHandle) -> bool:
        """Whether the job has pending items this worker may claim (of the models it serves);
        the job's pending count includes every model's."""
        if handle.models is None or handle.models.every:
            return True

        def read() -> bool:
            with self._reads.connect() as conn:
                return ledger.has_pending(conn, handle.job_id, handle.models)

        return retry_transient(read, should_stop=self._dead.is_set)

    @functools.cached_property
    def _reads(self) -> sa.Engine:
        """The pool for reads: none ends in a rollback (thinkbatch.db.reads)."""
        return reads(self.db)

    def _job_state(self, job_id: uuid.UUID) -> ledger.JobState | None:
        with self._reads.connect() as conn:
            return ledger.job_state(conn, job_id)

    def _heartbeat_job(self, job_id: uuid.UUID) -> ledger.JobState | None:
        # A driven job is alive: the sweeper must not re-hint it (HINT_STALE_S).
        with self.db.begin() as conn:
            ledger.mark_hinted(conn, job_id, unless_busy=True)
            return ledger.job_state(conn, job_id)

    def _expire(self, job_id: uuid.UUID) -> None:
        with self.db.begin() as conn:
            ledger.expire_job(conn, job_id)

    # --- the engine died ----------------------------------------------------------------------

    def _names_taken(self, error: Exception) -> None:
        """Judged dead during an outage, this worker came back to find a worker of another
        base model serving one of its names: it may not serve them beside it. It hands back
        what it holds, as at a shutdown, and exits as a worker refused at start does."""
        log.critical("served names taken while this worker was judged dead: %s; exiting", error)

        def leave() -> None:
            try:
                self.close()
            finally:  # whatever close met, the process must not stay up without a heartbeat
                logging.shutdown()
                self._exit(EXIT_NAMES_TAKEN)

        threading.Thread(target=leave, name="names-taken-exit", daemon=True).start()

    def _engine_died(self, error: BaseException) -> None:
        if self._dead.is_set():
            return
        self._dead.set()
        self._finished.set()  # wakes the housekeeper, which then sees it is dead
        self.stopping.set()
        log.critical("the engine died (%s); releasing items and exiting for a restart", error)
        threading.Thread(target=self._exit_after_crash, name="crash-exit", daemon=True).start()

    def _exit_after_crash(self) -> None:
        # Let the writer store what already finished, so only real in-flight items are
        # released and the suspect count is right.
        deadline = time.monotonic() + 5
        while not self.writer.idle() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(self.settings.write_interval_s * 2)
        try:
            with self.db.begin() as conn:
                ledger.release_crashed(
                    conn,
                    self.owner,
                    max_attempts=self.settings.max_attempts,
                    code="engine_crash",
                    message="the inference engine died while this item was in flight",
                )
                ledger.mark_stopped(conn, self.owner)
        except Exception:  # the sweeper releases them once our heartbeat stops
            log.exception("could not release items after the engine died")
        logging.shutdown()
        os._exit(EXIT_ENGINE_DEAD)
