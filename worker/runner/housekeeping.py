"""Housekeeping, on a thread of low priority: the worker's heartbeat, the recovery sweep, and
the pull of an idle worker: a runnable job with unclaimed items that this process does not
drive gets a task on this worker's own queue, so a worker that starts (or frees up) while
another holds every hint of a big job shares it within a heartbeat instead of waiting for a
hand-off."""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.db import reads
from thinkbatch.openai import batches
from thinkbatch.settings import Settings
from thinkbatch.sweeper import sweep
from worker.runner.suspects import Suspects
from worker.runner.window import InFlight

log = logging.getLogger(__name__)

# An idle worker that sent itself a hint for a job leaves that job alone this long, so a hint
# that is slow to arrive (or lost) is not followed by a stream of others.
ADOPT_AGAIN_AFTER_S = 30.0


def yield_cpu(nice: int = 10) -> None:
    """Lower this thread's CPU priority. Heartbeats, sweeps and progress reports can wait a few
    milliseconds; the engine cannot without idling its batch. Where the engine shares cores
    with them (vLLM on CPU here), its threads then preempt these rather than the reverse. The
    claimer and the writer keep normal priority: a starved claimer lets the engine's queue run
    dry, and a starved writer delays every stored result (both seen in the benchmark)."""
    if hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError:
            pass


class Housekeeper:
    def __init__(
        self,
        settings: Settings,
        db: sa.Engine,
        owner: str,
        *,
        inflight: InFlight,
        suspects: Suspects,
        publish: Callable[[uuid.UUID], bool],
        publish_here: Callable[[uuid.UUID], bool] | None,
        stopping: threading.Event,
        dead: threading.Event,
        finished: threading.Event | None = None,
        closed: threading.Event | None = None,
        names_taken: Callable[[Exception], None] | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.owner = owner
        self.inflight = inflight
        self.suspects = suspects
        self.publish = publish  # a hint any worker may take (the sweeper's re-hints)
        self.publish_here = publish_here  # a hint on this worker's own queue
        # Called when this worker, judged dead and back, finds its served names taken.
        self.names_taken = names_taken
        self.stopping = stopping
        self.dead = dead
        self.finished = finished or threading.Event()
        self.closed = closed or threading.Event()
        self._adopted: dict[uuid.UUID, float] = {}  # job -> when we sent ourselves a hint

    @functools.cached_property
    def _reads(self) -> sa.Engine:
        """The pool for reads: none ends in a rollback (thinkbatch.db.reads)."""
        return reads(self.db)

    def run(self) -> None:
        yield_cpu()
        next_sweep = time.monotonic() + self.settings.sweep_interval_s * 0.5
        last_beat = time.monotonic()
        judge_after = 0.0
        while not self.dead.is_set() and not self.closed.is_set():
            try:
                with self.db.begin() as conn:
                    ledger.beat(conn, self.owner, dead_after_s=self.settings.worker_dead_after_s)
                now = time.monotonic()
                if now - last_beat > 2 * self.settings.heartbeat_s + 1:
                    # We could not reach Postgres for a while, nor could the other workers:
                    # give them time to beat again before judging anyone dead.
                    judge_after = now + self.settings.worker_dead_after_s
                last_beat = now
                if now >= next_sweep and not self.stopping.is_set():
                    sweep(self.db, self.settings, self.publish, judge_workers=now >= judge_after)
                    next_sweep = time.monotonic() + self.settings.sweep_interval_s
                self.look_for_work()
            except ledger.ServedNameTaken as error:
                if self.names_taken is None:
                    raise
                self.names_taken(error)
                return
            except Exception as error:  # noqa: BLE001 - Postgres may be restarting
                log.warning("housekeeping failed: %s", error)
            # Keep beating while shutting down: our leases stand until we release them.
            self.wait_for_beat(time.monotonic() + self.settings.heartbeat_s)

    def wait_for_beat(self, until: float) -> None:
        """Wait until the next heartbeat is due, making the output files of batches that a
        store of this worker finished meanwhile at once: a finished batch is shown
        `finalizing` until they exist (thinkbatch/batches.py)."""
        while not self.dead.is_set() and (left := until - time.monotonic()) > 0:
            if not self.finished.wait(left) or self.dead.is_set() or self.closed.is_set():
                return
            self.finished.clear()
            try:
                batches.make_due_files(self.db)
            except Exception as error:  # noqa: BLE001 - the sweeper makes them later
                log.warning("could not make the output files of finished batches: %s", error)

    def idle(self) -> bool:
        """Half the window free and no job of ours with items left to claim."""
        if self.stopping.is_set() or self.suspects.running:
            return False
        if self.inflight.free() < max(1, self.inflight.size // 2):
            return False
        return not self.inflight.claimable()

    def look_for_work(self) -> None:
        """Pull, don't wait to be pushed: hints are spread by Redis as it pleases (one worker may
        take all of a job's), so an idle worker asks Postgres for a runnable job of its model
        with unclaimed items and sends itself a task for it. The task shows in Flower like any
        other; claims stay fenced, so two workers on one job split it without duplicates."""
        if self.publish_here is None or not self.idle():
            return
        now = time.monotonic()
        self._adopted = {j: at for j, at in self._adopted.items() if now - at < ADOPT_AGAIN_AFTER_S}
        mine = [*self.inflight.job_ids(), *self._adopted]
        with self._reads.connect() as conn:
            job_id = ledger.job_to_adopt(conn, models=self.settings.served_names, exclude=mine)
        if job_id is not None and self.publish_here(job_id):
            log.info("idle: taking a share of job %s", job_id)
            self._adopted[job_id] = now
