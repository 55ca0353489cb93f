"""The per-process runner: one engine, kept full across jobs, with results persisted in batches.

Threads of a worker process and what each does:

* the engine loop (asyncio): runs `engine.generate` for every item in flight;
* the claimer: leases items from Postgres in chunks whenever the window has room, sharing it
  between the jobs this process drives by weight, renders and tokenizes them, and hands them to
  the loop. The window is INFLIGHT_FACTOR x MAX_NUM_SEQS items, so the engine always has a
  queue to pull the next sequence from and never drains between chunks or jobs;
* the writer: stores finished items in batches (one fenced statement per batch), off the
  engine's path;
* the housekeeper: heartbeat, the recovery sweep, and the pull of an idle worker: a runnable
  job with unclaimed items that this process does not drive gets a task on this worker's own
  queue, so a worker that starts (or frees up) while another holds every hint of a big job
  shares it within a heartbeat instead of waiting for a hand-off;
* Celery task threads (`drive`): one per job being driven; each reports progress, watches for
  cancel and expiry, and returns once its items are settled.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.db import retry_transient
from thinkbatch.ledger import Claimed
from thinkbatch.ledger import Done
from thinkbatch.ledger import Failed
from thinkbatch.models import DEFAULT_TENANT
from thinkbatch.models import ItemStatus
from thinkbatch.models import JobStatus
from thinkbatch.sampling import Sampling
from thinkbatch.sampling import resolve_sampling
from thinkbatch.settings import Settings
from thinkbatch.sweeper import sweep
from thinkbatch.thinking import count_reasoning_tokens
from thinkbatch.thinking import split_thinking
from thinkbatch.thinking import thinking_truncated
from worker.engine import Engine
from worker.engine import EngineDead
from worker.engine import Generation
from worker.engine import ItemRejected
from worker.engine import Prepared
from worker.metrics import metrics

log = logging.getLogger(__name__)

EXIT_ENGINE_DEAD = 3
EXIT_SHUTDOWN_TIMEOUT = 4
PROGRESS_INTERVAL_S = 1.0
# An idle worker that sent itself a hint for a job leaves that job alone this long, so a hint
# that is slow to arrive (or lost) is not followed by a stream of others.
ADOPT_AGAIN_AFTER_S = 30.0


@dataclass(eq=False)
class JobHandle:
    """This process's view of one job it drives."""

    job_id: uuid.UUID
    weight: int
    params: dict[str, Any]
    tenant: str = DEFAULT_TENANT
    created_at: float = 0.0  # the job's, as a Unix time (for the latency metrics)
    inflight: int = 0  # handed to the engine, not yet returned
    unsettled: int = 0  # claimed, result not yet stored
    claim_open: bool = True
    exhausted_until: float = 0.0  # the last claim found nothing; look again after this
    suspects: bool = False
    settled: threading.Event = field(default_factory=threading.Event)
    # The handle this one took the job over from at a slice hand-off; its tail is still in the
    # engine and counts towards the job's share until it drains.
    predecessor: JobHandle | None = None

    def job_inflight(self) -> int:
        """Items of this job in the engine, under this handle and the ones it took over from."""
        n, handle = self.inflight, self.predecessor
        while handle is not None:
            n += handle.inflight
            handle = handle.predecessor
        if self.predecessor is not None and n == self.inflight:
            self.predecessor = None  # drained: let it go
        return n


@dataclass(eq=False)
class Flight:
    claimed: Claimed
    prepared: Prepared
    handle: JobHandle
    started: float
    quarantined: bool = False
    task: asyncio.Task[None] | None = None
    abort_reason: str | None = None


@dataclass(frozen=True)
class Outcome:
    flight: Flight | None
    claimed: Claimed
    handle: JobHandle
    kind: str  # done | rejected | error | aborted
    generation: Generation | None = None
    code: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class _Raised:
    """The exception the engine raised while preparing one item."""

    error: Exception


def _text_chars(item: Claimed) -> int:
    """The length of an item's text in characters: what rendering and tokenizing cost grows with."""
    if item.messages is None:
        return len(item.prompt or "")
    return sum(len(str(m.get("content") or "")) for m in item.messages if isinstance(m, dict))


def _message(error: BaseException) -> str:
    """The error's own words for the item's record (its type when it has none)."""
    return str(error).strip() or type(error).__name__


def fair_shares(window: int, handles: list[JobHandle]) -> dict[JobHandle, float]:
    """Each handle's share of the engine's window: equal between tenants, then by priority
    weight between one tenant's jobs. So a tenant's many jobs (or its high priorities) never
    crowd out another tenant's one job: priority orders a tenant's own work."""
    by_tenant: dict[str, list[JobHandle]] = {}
    for handle in handles:
        by_tenant.setdefault(handle.tenant, []).append(handle)
    per_tenant = window / len(by_tenant)
    shares: dict[JobHandle, float] = {}
    for own in by_tenant.values():
        total = sum(h.weight for h in own)
        for handle in own:
            shares[handle] = per_tenant * handle.weight / total
    return shares


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


class Runner:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        db: sa.Engine,
        publish: Callable[[uuid.UUID], bool],
        publish_here: Callable[[uuid.UUID], bool] | None = None,
    ):
        self.settings = settings
        self.engine = engine
        self.db = db
        self.publish = publish  # a hint any worker may take
        self.publish_here = publish_here  # a hint on this worker's own queue
        self._adopted: dict[uuid.UUID, float] = {}  # job -> when we sent ourselves a hint
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self.window = settings.inflight_window
        # Claim in chunks (fewer round trips) but early enough that the engine's own queue
        # (window - max_num_seqs items) never runs dry.
        self.claim_min = max(1, min(64, self.window // 8))
        self.claim_max = max(1, self.window // 4)
        self.launch_chunk = max(16, settings.max_num_seqs // 4)
        self._lock = threading.Lock()
        self._handles: dict[uuid.UUID, JobHandle] = {}
        self._inflight = 0
        self._quarantine = 0  # suspects running alone; nothing else is claimed meanwhile
        self._flights: set[Flight] = set()
        self._outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._wake = threading.Event()
        self.stopping = threading.Event()
        self._dead = threading.Event()
        self._threads: list[threading.Thread] = []
        # One thread for items with a long text (see _launch_slice): it runs beside the
        # claimer, and one at a time leaves the cores to the engine.
        self._aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-large")
        self.loop = asyncio.new_event_loop()
        self.stats = {"claims": 0, "claimed": 0, "writes": 0, "written": 0}

    def describe(self) -> dict[str, Any]:
        """Model, engine settings and load, for the worker's stats (Flower) and metrics."""
        s = self.settings
        with self._lock:
            jobs = {str(j): h.job_inflight() for j, h in self._handles.items()}
        return {
            "owner": self.owner,
            "model": s.model_name,
            "engine": s.engine,
            "max_num_seqs": s.max_num_seqs,
            "max_model_len": s.max_model_len,
            "dtype": s.dtype,
            "tensor_parallel_size": s.tensor_parallel_size,
            "window": self.window,
            "items_in_engine": self._inflight,
            "jobs_in_flight": jobs,
        }

    # --- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        loop_thread = threading.Thread(
            target=self.loop.run_forever, name="engine-loop", daemon=True
        )
        loop_thread.start()
        self._threads.append(loop_thread)
        asyncio.run_coroutine_threadsafe(self.engine.start(), self.loop).result()
        # Register once the engine is up and the heartbeat is about to start: a row registered
        # before a load that takes minutes would be judged dead by the other workers.
        self._register_worker()
        asyncio.run_coroutine_threadsafe(self._watch_deadlines(), self.loop)
        for target, name in (
            (self._claim_loop, "claimer"),
            (self._write_loop, "writer"),
            (self._housekeeping_loop, "housekeeper"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("runner %s ready: window=%d items", self.owner, self.window)

    def begin_shutdown(self) -> None:
        """Stop claiming and hand back what is in flight. Safe to call from a signal handler."""
        if self.stopping.is_set():
            return
        log.warning("shutting down: releasing %d in-flight item(s)", self._inflight)
        self.stopping.set()
        self._wake.set()
        self.loop.call_soon_threadsafe(self._abort_where, lambda f: True, "shutdown")

    def close(self, timeout: float | None = None) -> None:
        """Wait for the writer to store what it holds, then stop the engine."""
        self.begin_shutdown()
        deadline = time.monotonic() + (timeout or self.settings.shutdown_timeout_s)
        while time.monotonic() < deadline and (self._inflight or not self._outcomes.empty()):
            time.sleep(0.05)
        self._outcomes.put(None)
        self._aside.shutdown(wait=False)
        for thread in self._threads:
            if thread.name == "writer":
                thread.join(max(0.0, deadline - time.monotonic()))
        try:
            future = asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self.loop)
            future.result(max(1.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - the process exits next; the reaper cleans up
            log.exception("engine shutdown failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        try:
            with self.db.begin() as conn:
                conn.execute(
                    sa.text("UPDATE workers SET stopped_at = now() WHERE id = :id"),
                    {"id": self.owner},
                )
        except Exception:  # noqa: BLE001 - best effort; the heartbeat lapses anyway
            log.warning("could not mark worker %s stopped", self.owner)

    def _register_worker(self) -> None:
        def register() -> None:
            with self.db.begin() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO workers (id, hostname, pid, model) "
                        "VALUES (:id, :host, :pid, :model)"
                    ),
                    {
                        "id": self.owner,
                        "host": socket.gethostname(),
                        "pid": os.getpid(),
                        "model": self.settings.model_name,
                    },
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
                    reason = "expired" if state.expired else "cancelled"
                    handle.claim_open = False
                    self.loop.call_soon_threadsafe(
                        self._abort_where, lambda f: f.handle is handle, reason
                    )
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
                        handle.exhausted_until = 0.0  # items came back (released); claim again
                        self._wake.set()
        finally:
            with self._lock:
                if self._handles.get(job_id) is handle:  # a successor may have taken over
                    del self._handles[job_id]
        pending = state.pending if state is not None else 0
        runnable = state is not None and state.status in ledger.RUNNABLE
        if pending and runnable and not handed_off:
            # Items are left that nobody was told about: released on shutdown, or returned by
            # a crash or a retry after claiming closed.
            self.publish(job_id)
        return {"job_id": str(job_id), "done": state.done if state else 0, "pending": pending}

    def _attach(self, job_id: uuid.UUID) -> JobHandle | None:
        with self.db.connect() as conn:
            row = conn.execute(
                sa.text(
                    "SELECT model, params, priority, status, tenant, created_at"
                    " FROM jobs WHERE id = :id"
                ),
                {"id": job_id},
            ).first()
        if row is None or row.status not in ledger.RUNNABLE:
            return None
        if row.model != self.settings.model_name:
            with self.db.begin() as conn:
                ledger.fail_job(
                    conn,
                    job_id,
                    code="model_not_served",
                    message=f"this deployment serves {self.settings.model_name!r}, "
                    f"not {row.model!r}",
                )
            return None
        with self._lock:
            current = self._handles.get(job_id)
            if (current is not None and current.claim_open) or self.stopping.is_set():
                return None  # another task of this process already drives it
            if self._tenant_full(row.tenant, job_id):
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
                tenant=row.tenant,
                created_at=row.created_at.timestamp(),
                predecessor=current,
            )
            self._handles[job_id] = handle
        self._wake.set()
        return handle

    def _tenant_full(self, tenant: str, job_id: uuid.UUID) -> bool:
        """Whether this tenant already has TENANT_MAX_JOBS_PER_WORKER other jobs open for
        claims here (call with the lock held)."""
        open_jobs = {
            h.job_id
            for h in self._handles.values()
            if h.tenant == tenant and h.claim_open and h.job_id != job_id
        }
        return len(open_jobs) >= self.settings.tenant_max_jobs_per_worker

    def _job_state(self, job_id: uuid.UUID) -> ledger.JobState | None:
        with self.db.connect() as conn:
            return ledger.job_state(conn, job_id)

    def _heartbeat_job(self, job_id: uuid.UUID) -> ledger.JobState | None:
        with self.db.begin() as conn:
            conn.execute(
                sa.text("UPDATE jobs SET hinted_at = now() WHERE id = :id"), {"id": job_id}
            )
            return ledger.job_state(conn, job_id)

    def _expire(self, job_id: uuid.UUID) -> None:
        with self.db.begin() as conn:
            ledger.expire_job(conn, job_id)

    # --- claiming ---------------------------------------------------------------------------

    def _claim_loop(self) -> None:
        while not self.stopping.is_set():
            self._wake.wait(0.1)
            self._wake.clear()
            try:
                self._claim_round()
            except Exception:  # noqa: BLE001 - keep claiming; the error is logged
                log.exception("claim round failed")
                time.sleep(1)

    def _claimable(self) -> list[JobHandle]:
        now = time.monotonic()
        with self._lock:
            return [h for h in self._handles.values() if h.claim_open and h.exhausted_until < now]

    def _claim_round(self) -> None:
        while not self.stopping.is_set() and not self._quarantine:
            handles = self._claimable()
            if not handles:
                return
            suspects = [h for h in handles if h.suspects]
            if suspects:
                # Drain the engine, then run one group of suspects alone.
                if self._inflight == 0:
                    self._claim_into(suspects[0], 0, suspects=True)
                return
            free = self.window - self._inflight
            if free <= 0 or (free < self.claim_min and self._inflight > 0):
                return
            handle, n = self._pick(handles, free)
            self._claim_into(handle, n, suspects=False)

    def _pick(self, handles: list[JobHandle], free: int) -> tuple[JobHandle, int]:
        """Fair share (see fair_shares): the job furthest below its share goes next."""
        shares = fair_shares(self.window, handles)
        inflight = {h: h.job_inflight() for h in handles}
        best = max(handles, key=lambda h: shares[h] - inflight[h])
        deficit = shares[best] - inflight[best]
        # An engine running less than a full batch gets its whole window in one claim (a job's
        # start, or after a lull); afterwards chunks of claim_max keep its queue topped up.
        chunk = self.window if self._inflight < self.settings.max_num_seqs else self.claim_max
        n = min(free, chunk, max(self.claim_min, math.ceil(deficit)))
        return best, max(1, n)

    def _claim_into(self, handle: JobHandle, n: int, *, suspects: bool) -> None:
        def claim() -> list[Claimed]:
            with self.db.begin() as conn:
                items = ledger.claim(
                    conn,
                    handle.job_id,
                    owner=self.owner,
                    n=n,
                    lease_s=self.settings.lease_s,
                    suspects=suspects,
                )
                if not items and not suspects:
                    handle.suspects = ledger.has_suspects(conn, handle.job_id)
                return items

        claimed = retry_transient(claim, should_stop=self.stopping.is_set)
        self.stats["claims"] += 1
        self.stats["claimed"] += len(claimed)
        if not claimed:
            if suspects:
                handle.suspects = False
            if not handle.suspects:
                handle.exhausted_until = time.monotonic() + 1.0
            return
        if suspects:
            handle.suspects = False
            log.warning("running %d crash suspect(s) of job %s alone", len(claimed), handle.job_id)
        with self._lock:
            handle.unsettled += len(claimed)
        # Render, tokenize and launch in slices: the engine starts on the first slice while
        # the rest of a big claim (a whole window at a job's start) is still being rendered.
        for start in range(0, len(claimed), self.launch_chunk):
            self._launch_slice(handle, claimed[start : start + self.launch_chunk], suspects)

    def _launch_slice(self, handle: JobHandle, claimed: list[Claimed], suspects: bool) -> None:
        """Hand a slice of claimed items to the engine. Items with a long text are prepared on
        the side thread: tokenizing a prompt of megabytes takes seconds, and on this thread it
        would hold back every other item's way to the engine (and so the whole batch)."""
        limit = self.settings.prepare_inline_max_chars
        large: list[Claimed] = []
        if not suspects:  # suspects run alone in a drained engine: nothing to hold back
            try:
                large = [c for c in claimed if _text_chars(c) > limit]
            except Exception:  # noqa: BLE001 - a malformed item is dealt with by _build
                large = []
        if large:
            aside = {id(c) for c in large}
            claimed = [c for c in claimed if id(c) not in aside]
            # They hold their place in the window while they wait, as if in the engine.
            with self._lock:
                self._inflight += len(large)
                handle.inflight += len(large)
            try:
                self._aside.submit(self._prepare_and_launch, handle, large, False, len(large))
            except RuntimeError:  # shut down (the runner is closing): prepare them here
                self._prepare_and_launch(handle, large, False, len(large))
        if claimed:
            self._prepare_and_launch(handle, claimed, suspects, 0)

    def _prepare_and_launch(
        self, handle: JobHandle, claimed: list[Claimed], suspects: bool, reserved: int
    ) -> None:
        """Every claimed item ends in exactly one place: the engine, or an outcome for the
        writer. An item that ended in neither would stay `running` for good, and with it its
        job, a cancel of that job, and the task thread waiting for the job to settle."""
        try:
            flights, outcomes = self._build(handle, claimed, suspects)
        except Exception as error:  # noqa: BLE001 - a defect here is not the items' fault
            log.exception("could not prepare %d item(s); they are retried", len(claimed))
            flights = []
            outcomes = [
                Outcome(None, c, handle, "error", code="worker_error", message=repr(error))
                for c in claimed
            ]
        if flights and self.stopping.is_set():
            # Prepared after shutdown began (on the side thread): hand them back untouched.
            outcomes += [Outcome(f, f.claimed, handle, "aborted", code="shutdown") for f in flights]
            flights = []
        for outcome in outcomes:
            self._outcomes.put(outcome)
        with self._lock:
            self._inflight += len(flights) - reserved
            handle.inflight += len(flights) - reserved
            if suspects:
                self._quarantine += len(flights)
        if flights:
            self.loop.call_soon_threadsafe(self._launch, flights)
        elif reserved:
            self._wake.set()  # window room came back without a launch: claim again

    def _build(
        self, handle: JobHandle, claimed: list[Claimed], suspects: bool
    ) -> tuple[list[Flight], list[Outcome]]:
        """Resolve sampling, render, tokenize and build the engine's parameters: flights for
        the items that are ready, outcomes for the ones that are not."""
        outcomes: list[Outcome] = []
        items: list[Claimed] = []
        sampling: list[Sampling] = []
        for item in claimed:
            try:
                sampling.append(
                    resolve_sampling(
                        handle.params,
                        item.params,
                        default_max_tokens=self.settings.default_max_tokens,
                    )
                )
                items.append(item)
            except Exception as error:  # noqa: BLE001 - a stored value the worker cannot use
                outcomes.append(
                    Outcome(None, item, handle, "rejected", code="invalid_request",
                            message=f"invalid sampling parameters: {_message(error)}")
                )  # fmt: skip
        prepared = self._prepare(items, sampling)
        # An item that fails alone while a batch-mate gets through is the cause: it fails now.
        # When every item fails, the cause may as well be ours (a broken tokenizer): each is
        # retried, with an attempt counted, so a worker fault costs nobody their result and an
        # item that fails everywhere still ends `failed` after MAX_ATTEMPTS.
        blamed = any(not isinstance(p, _Raised) for p in prepared)
        flights: list[Flight] = []
        now = time.monotonic()
        for item, ready in zip(items, prepared, strict=True):
            if isinstance(ready, ItemRejected):
                outcomes.append(
                    Outcome(None, item, handle, "rejected", code=ready.code, message=ready.message)
                )
            elif isinstance(ready, _Raised):
                kind = "rejected" if blamed else "error"
                outcomes.append(
                    Outcome(None, item, handle, kind, code="invalid_request",
                            message=_message(ready.error))
                )  # fmt: skip
            else:
                flights.append(
                    Flight(claimed=item, prepared=ready, handle=handle, started=now,
                           quarantined=suspects)
                )  # fmt: skip
        return flights, outcomes

    def _prepare(
        self, items: list[Claimed], sampling: list[Sampling]
    ) -> list[Prepared | ItemRejected | _Raised]:
        """The engine's prepare, with an exception confined to the items that cause it: when
        the batched call raises, each item is prepared alone."""
        if not items:
            return []
        try:
            prepared: list[Prepared | ItemRejected | _Raised] = list(
                self.engine.prepare(items, sampling)
            )
            if len(prepared) != len(items):
                raise RuntimeError(f"prepare returned {len(prepared)} of {len(items)} items")
            return prepared
        except Exception as error:  # noqa: BLE001 - find out whose it is
            if len(items) == 1:
                return [_Raised(error)]
            # The type only: an engine's message may quote the prompt, which the logs never hold.
            log.warning(
                "preparing %d items failed (%s); preparing each alone",
                len(items),
                type(error).__name__,
            )
        out: list[Prepared | ItemRejected | _Raised] = []
        for item, params in zip(items, sampling, strict=True):
            try:
                (one,) = self.engine.prepare([item], [params])
                out.append(one)
            except Exception as error:  # noqa: BLE001 - this item's own failure
                out.append(_Raised(error))
        return out

    # --- the engine loop ----------------------------------------------------------------------

    def _launch(self, flights: list[Flight]) -> None:
        for flight in flights:
            self._flights.add(flight)
            flight.task = self.loop.create_task(self._run(flight))
            flight.task.add_done_callback(lambda _, f=flight: self._unstarted(f))

    def _unstarted(self, flight: Flight) -> None:
        """A task cancelled before its first step never enters _run's handlers: settle its
        item here, or it would stay in flight (and `running`) for good."""
        if flight in self._flights:
            self._settle(
                flight,
                Outcome(flight, flight.claimed, flight.handle, "aborted",
                        code=flight.abort_reason or "shutdown"),
            )  # fmt: skip

    async def _run(self, flight: Flight) -> None:
        item = flight.claimed
        request_id = f"{item.id}-{item.attempt}"
        try:
            generation = await self.engine.generate(request_id, flight.prepared)
            outcome = Outcome(flight, item, flight.handle, "done", generation=generation)
        except asyncio.CancelledError:
            outcome = Outcome(
                flight, item, flight.handle, "aborted", code=flight.abort_reason or ""
            )
        except EngineDead as error:
            self._flights.discard(flight)
            self._engine_died(error)
            return
        except ItemRejected as error:
            outcome = Outcome(
                flight, item, flight.handle, "rejected", code=error.code, message=error.message
            )
        except Exception as error:  # noqa: BLE001 - an unexpected per-item failure is retried
            log.warning(
                "item %s failed in the engine: %s",
                item.id,
                type(error).__name__,
                extra={"job_id": str(item.job_id), "item_id": item.id},
            )
            outcome = Outcome(
                flight, item, flight.handle, "error", code="engine_error", message=repr(error)
            )
        self._settle(flight, outcome)

    def _settle(self, flight: Flight, outcome: Outcome) -> None:
        self._flights.discard(flight)
        engine_s = time.monotonic() - flight.started
        created = flight.handle.created_at
        queued_s = time.time() - engine_s - created if created else None
        metrics.left_engine(outcome.kind, engine_s, queued_s)
        with self._lock:
            self._inflight -= 1
            flight.handle.inflight -= 1
        self._outcomes.put(outcome)
        self._wake.set()

    def _abort_where(self, predicate: Callable[[Flight], bool], reason: str) -> None:
        for flight in list(self._flights):
            if flight.abort_reason is None and predicate(flight) and flight.task is not None:
                flight.abort_reason = reason
                flight.task.cancel()

    async def _watch_deadlines(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            limit = time.monotonic() - self.settings.item_deadline_s
            self._abort_where(lambda f, limit=limit: f.started < limit, "deadline")

    def _engine_died(self, error: BaseException) -> None:
        if self._dead.is_set():
            return
        self._dead.set()
        self.stopping.set()
        log.critical("the engine died (%s); releasing items and exiting for a restart", error)
        threading.Thread(target=self._exit_after_crash, name="crash-exit", daemon=True).start()

    def _exit_after_crash(self) -> None:
        # Let the writer store what already finished, so only real in-flight items are
        # released and the suspect count is right.
        deadline = time.monotonic() + 5
        while not self._outcomes.empty() and time.monotonic() < deadline:
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
                conn.execute(
                    sa.text("UPDATE workers SET stopped_at = now() WHERE id = :id"),
                    {"id": self.owner},
                )
        except Exception:  # noqa: BLE001 - the sweeper releases them once our heartbeat stops
            log.exception("could not release items after the engine died")
        logging.shutdown()
        os._exit(EXIT_ENGINE_DEAD)

    # --- persisting -------------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            first = self._outcomes.get()
            if first is None:
                return
            batch = [first]
            deadline = time.monotonic() + self.settings.write_interval_s
            closing = False
            while len(batch) < self.settings.write_batch_max:
                if self._inflight == 0 and self._outcomes.empty():
                    break  # the engine is empty: nothing more is coming soon, so store it now
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    break
                try:
                    nxt = self._outcomes.get(timeout=timeout)
                except queue.Empty:
                    break
                if nxt is None:
                    closing = True
                    break
                batch.append(nxt)
            self._persist(batch)
            if closing:
                return

    def _persist(self, batch: list[Outcome]) -> None:
        done: list[Done] = []
        failed: list[Failed] = []
        ended: dict[str, list[tuple[int, uuid.UUID, int]]] = {"cancelled": [], "expired": []}
        released: list[tuple[int, uuid.UUID, int]] = []
        for outcome in batch:
            item = outcome.claimed
            key = (item.id, item.job_id, item.attempt)
            if outcome.kind == "done":
                assert outcome.generation is not None and outcome.flight is not None
                done.append(self._to_done(item, outcome.flight.prepared, outcome.generation))
            elif outcome.kind == "rejected":
                failed.append(Failed(*key, outcome.code, outcome.message, retryable=False))
            elif outcome.kind == "error":
                failed.append(Failed(*key, outcome.code, outcome.message, retryable=True))
            elif outcome.code in ended:
                ended[outcome.code].append(key)
            elif outcome.code == "deadline":
                message = f"no result within ITEM_DEADLINE_S={self.settings.item_deadline_s:g}s"
                failed.append(Failed(*key, "timeout", message, retryable=True))
            else:  # shutdown
                released.append(key)

        stored: dict[str, Any] = {}  # what the fenced writes took, for the metrics

        def write() -> None:
            with self.db.begin() as conn:
                stored["done"] = ledger.complete(conn, self.owner, done)
                stored["failed"] = ledger.fail(
                    conn, self.owner, failed, max_attempts=self.settings.max_attempts
                )
                for status, keys in ended.items():
                    ledger.end_items(
                        conn,
                        self.owner,
                        keys,
                        status=ItemStatus(status),
                        code=status,
                        message=f"the job was {status} while this item ran",
                    )
                ledger.release(conn, self.owner, released)
                ledger.finalize_jobs(conn, {o.claimed.job_id for o in batch})

        try:
            retry_transient(write, should_stop=self._dead.is_set)
            self.stats["writes"] += 1
            self.stats["written"] += len(batch)
            metrics.stored(done, failed, stored.get("done", set()), stored.get("failed", {}))
        except Exception:  # noqa: BLE001 - the leases lapse and the sweeper retries the items
            log.exception("could not store %d result(s)", len(batch))
        touched: set[JobHandle] = set()
        with self._lock:
            for outcome in batch:
                outcome.handle.unsettled -= 1
                touched.add(outcome.handle)
                if outcome.flight is not None and outcome.flight.quarantined:
                    self._quarantine -= 1
        for handle in touched:
            handle.settled.set()
        self._wake.set()

    def _to_done(self, item: Claimed, prepared: Prepared, gen: Generation) -> Done:
        split = split_thinking(gen.text, opened_in_prompt=prepared.opened_in_prompt)
        think = self.engine.think
        reasoning = count_reasoning_tokens(
            gen.token_ids,
            start_id=think.start_id,
            end_id=think.end_id,
            opened_in_prompt=prepared.opened_in_prompt,
        )
        budget = prepared.sampling.thinking_budget
        return Done(
            item_id=item.id,
            job_id=item.job_id,
            attempt=item.attempt,
            thinking=split.thinking,
            answer=split.answer,
            finish_reason=gen.finish_reason,
            thinking_truncated=thinking_truncated(split, reasoning_tokens=reasoning, budget=budget),
            prompt_tokens=gen.prompt_tokens,
            completion_tokens=len(gen.token_ids),
            reasoning_tokens=reasoning,
        )

    # --- housekeeping -----------------------------------------------------------------------

    def _idle(self) -> bool:
        """Half the window free and no job of ours with items left to claim."""
        if self.stopping.is_set() or self._quarantine:
            return False
        if self.window - self._inflight < max(1, self.window // 2):
            return False
        return not self._claimable()

    def _look_for_work(self) -> None:
        """Pull, don't wait to be pushed: hints are spread by Redis as it pleases (one worker may
        take all of a job's), so an idle worker asks Postgres for a runnable job of its model
        with unclaimed items and sends itself a task for it. The task shows in Flower like any
        other; claims stay fenced, so two workers on one job split it without duplicates."""
        if self.publish_here is None or not self._idle():
            return
        now = time.monotonic()
        self._adopted = {j: at for j, at in self._adopted.items() if now - at < ADOPT_AGAIN_AFTER_S}
        with self._lock:
            mine = [*self._handles, *self._adopted]
        with self.db.connect() as conn:
            job_id = conn.execute(
                sa.text(
                    "SELECT id FROM jobs WHERE status IN ('queued', 'running') AND pending > 0"
                    " AND model = :model AND expires_at > now() AND NOT (id = ANY(:mine))"
                    " ORDER BY priority DESC, created_at LIMIT 1"
                ),
                {"model": self.settings.model_name, "mine": mine},
            ).scalar()
        if job_id is not None and self.publish_here(job_id):
            log.info("idle: taking a share of job %s", job_id)
            self._adopted[job_id] = now

    def _housekeeping_loop(self) -> None:
        yield_cpu()
        next_sweep = time.monotonic() + self.settings.sweep_interval_s * 0.5
        last_beat = time.monotonic()
        judge_after = 0.0
        while not self._dead.is_set():
            try:
                with self.db.begin() as conn:
                    conn.execute(
                        sa.text(
                            "UPDATE workers SET heartbeat_at = now(), stopped_at = NULL "
                            "WHERE id = :id"
                        ),
                        {"id": self.owner},
                    )
                now = time.monotonic()
                if now - last_beat > 2 * self.settings.heartbeat_s + 1:
                    # We could not reach Postgres for a while, nor could the other workers:
                    # give them time to beat again before judging anyone dead.
                    judge_after = now + self.settings.worker_dead_after_s
                last_beat = now
                if now >= next_sweep and not self.stopping.is_set():
                    sweep(self.db, self.settings, self.publish, judge_workers=now >= judge_after)
                    next_sweep = time.monotonic() + self.settings.sweep_interval_s
                self._look_for_work()
            except Exception as error:  # noqa: BLE001 - Postgres may be restarting
                log.warning("housekeeping failed: %s", error)
            # Keep beating while shutting down: our leases stand until we release them.
            self._dead.wait(self.settings.heartbeat_s)
