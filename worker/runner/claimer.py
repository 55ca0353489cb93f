"""The claimer: leases items from Postgres in chunks whenever the window has room, sharing it
between the jobs this process drives (fairness.py), renders and tokenizes them, and hands
them to the engine loop. The window is INFLIGHT_FACTOR x MAX_NUM_SEQS items, so the engine
always has a queue to pull the next sequence from and never drains between chunks or jobs; it
grows towards INFLIGHT_MAX_FACTOR while the engine finishes items fast (window.InFlight)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.db import retry_transient
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import Sampling
from thinkbatch.sampling import resolve_sampling
from thinkbatch.settings import Settings
from worker.engine import Engine
from worker.engine import ItemRejected
from worker.engine import Prepared
from worker.runner.engine_loop import EngineLoop
from worker.runner.fairness import pick
from worker.runner.suspects import Suspects
from worker.runner.window import AbortReason
from worker.runner.window import Flight
from worker.runner.window import InFlight
from worker.runner.window import JobHandle
from worker.runner.writer import Outcome
from worker.runner.writer import OutcomeKind
from worker.runner.writer import Writer
from worker.stages import clock

log = logging.getLogger(__name__)


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


class Claimer:
    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        db: sa.Engine,
        owner: str,
        *,
        inflight: InFlight,
        suspects: Suspects,
        engine_loop: EngineLoop,
        writer: Writer,
        stopping: threading.Event,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.db = db
        self.owner = owner
        self.inflight = inflight
        self.suspects = suspects
        self.engine_loop = engine_loop
        self.writer = writer
        self.stopping = stopping
        self._chunks(inflight.size)  # claim_min, claim_max: they follow the window's size
        self.launch_chunk = max(16, settings.max_num_seqs // 4)
        # One thread for items with a long text (see launch_slice): it runs beside the
        # claimer, and one at a time leaves the cores to the engine.
        self._aside = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare-large")

    def close(self) -> None:
        self._aside.shutdown(wait=False)

    def _chunks(self, window: int) -> None:
        # Claim in chunks (fewer round trips) but early enough that the engine's own queue
        # (window - max_num_seqs items) never runs dry.
        self.claim_min = max(1, min(64, window // 8))
        self.claim_max = max(1, window // 4)

    def run(self) -> None:
        while not self.stopping.is_set():
            self.inflight.wake.wait(0.1)
            self.inflight.wake.clear()
            try:
                self.claim_round()
            except Exception:  # keep claiming; the error is logged
                log.exception("claim round failed")
                time.sleep(1)

    def claim_round(self) -> None:
        while not self.stopping.is_set() and not self.suspects.running:
            self._chunks(self.inflight.resize())
            handles = self.inflight.claimable()
            if not handles:
                return
            suspects = self.suspects.waiting(handles)
            if suspects:
                # Drain the engine, then run one group of suspects alone.
                if self.inflight.count == 0:
                    self.claim_into(suspects[0], 0, suspects=True)
                return
            free = self.inflight.free()
            if free <= 0 or (free < self.claim_min and self.inflight.count > 0):
                return
            # A job holding its allowance waits, and its share goes to the others.
            room = {h: self.inflight.allowance(h) - h.job_inflight() for h in handles}
            handles = [h for h in handles if room[h] > 0]
            if not handles:
                return
            handle, n = self.pick(handles, free)
            self.claim_into(handle, min(n, room[handle]), suspects=False)

    def pick(self, handles: list[JobHandle], free: int) -> tuple[JobHandle, int]:
        # An idle engine gets one launch slice first: claiming and rendering a whole window
        # before the first launch kept the engine idle 60-70 ms longer at a job's start
        # (`make bench`, 512 items). Then an engine running less than a full batch gets the
        # rest of its window in one claim; afterwards chunks of claim_max keep its queue
        # topped up.
        count = self.inflight.count
        if count == 0:
            chunk = self.launch_chunk
        elif count < self.settings.max_num_seqs:
            chunk = self.inflight.size
        else:
            chunk = self.claim_max
        return pick(
            self.inflight.size,
            handles,
            {h: h.job_inflight() for h in handles},
            free=free,
            chunk=chunk,
            claim_min=self.claim_min,
        )

    def claim_into(self, handle: JobHandle, n: int, *, suspects: bool) -> None:
        turn = next(handle.turns)

        def claim() -> list[Claimed]:
            with self.db.begin() as conn:
                items = ledger.claim(
                    conn,
                    handle.job_id,
                    owner=self.owner,
                    n=n,
                    lease_s=self.settings.lease_s,
                    suspects=suspects,
                    models=handle.models,
                    turn=turn,
                )
                if not items and not suspects:
                    self.suspects.flag(
                        handle, ledger.has_suspects(conn, handle.job_id, handle.models)
                    )
                return items

        with clock.measure("claim"):
            claimed = retry_transient(claim, should_stop=self.stopping.is_set)
        if not claimed:
            if suspects:
                self.suspects.flag(handle, False)
            if not self.suspects.has_waiting(handle):
                handle.exhausted_until = time.monotonic() + 1.0
            return
        if handle.models is not None:
            for item in claimed:  # the job's own model, named for the engine
                if item.model is None:
                    item.model = handle.models.job_model
        if suspects:
            self.suspects.flag(handle, False)
            log.warning("running %d crash suspect(s) of job %s alone", len(claimed), handle.job_id)
        with self.inflight.lock:
            handle.unsettled += len(claimed)
        # Render, tokenize and launch in slices: the engine starts on the first slice while
        # the rest of a big claim (a whole window at a job's start) is still being rendered.
        for start in range(0, len(claimed), self.launch_chunk):
            self.launch_slice(handle, claimed[start : start + self.launch_chunk], suspects)

    def launch_slice(self, handle: JobHandle, claimed: list[Claimed], suspects: bool) -> None:
        """Hand a slice of claimed items to the engine. Items with a long text are prepared on
        the side thread: tokenizing a prompt of megabytes takes seconds, and on this thread it
        would hold back every other item's way to the engine (and so the whole batch)."""
        limit = self.settings.prepare_inline_max_chars
        large: list[Claimed] = []
        if not suspects:  # suspects run alone in a drained engine: nothing to hold back
            try:
                large = [c for c in claimed if _text_chars(c) > limit]
            except Exception:  # noqa: BLE001 - a malformed item is dealt with by build
                large = []
        if large:
            aside = {id(c) for c in large}
            claimed = [c for c in claimed if id(c) not in aside]
            # They hold their place in the window while they wait, as if in the engine.
            self.inflight.add(handle, len(large))
            try:
                self._aside.submit(self.prepare_and_launch, handle, large, False, len(large))
            except RuntimeError:  # shut down (the runner is closing): prepare them here
                self.prepare_and_launch(handle, large, False, len(large))
        if claimed:
            self.prepare_and_launch(handle, claimed, suspects, 0)

    def prepare_and_launch(
        self, handle: JobHandle, claimed: list[Claimed], suspects: bool, reserved: int
    ) -> None:
        """Every claimed item ends in exactly one place: the engine, or an outcome for the
        writer. An item that ended in neither would stay `running` for good, and with it its
        job, a cancel of that job, and the task thread waiting for the job to settle."""
        start = time.thread_time()
        try:
            flights, outcomes, prepare_s = self.build(handle, claimed, suspects)
        except Exception as error:  # a defect here is not the items' fault
            log.exception("could not prepare %d item(s); they are retried", len(claimed))
            flights, prepare_s = [], 0.0
            outcomes = [
                Outcome(None, c, handle, OutcomeKind.error, code="worker_error",
                        message=repr(error))
                for c in claimed
            ]  # fmt: skip
        if flights and self.stopping.is_set():
            # Prepared after shutdown began (on the side thread): hand them back untouched.
            outcomes += [
                Outcome(f, f.claimed, handle, OutcomeKind.aborted, reason=AbortReason.shutdown)
                for f in flights
            ]
            flights = []
        for outcome in outcomes:
            self.writer.put(outcome)
        self.inflight.add(handle, len(flights) - reserved)
        if suspects:
            self.suspects.entered(len(flights))
        if flights:
            self.engine_loop.launch(flights)
        elif reserved:
            self.inflight.wake.set()  # window room came back without a launch: claim again
        clock.add("launch", time.thread_time() - start - prepare_s)

    def build(
        self, handle: JobHandle, claimed: list[Claimed], suspects: bool
    ) -> tuple[list[Flight], list[Outcome], float]:
        """Resolve sampling, render, tokenize and build the engine's parameters: flights for
        the items that are ready, outcomes for the ones that are not, and the CPU seconds the
        render and tokenize took (the `prepare` stage)."""
        outcomes: list[Outcome] = []
        items: list[Claimed] = []
        sampling: list[Sampling] = []
        # Items without parameters of their own share the job's (immutable) sampling: resolved
        # once per slice rather than once per item.
        shared: Sampling | Exception | None = None
        for item in claimed:
            try:
                if item.params:
                    own = resolve_sampling(
                        handle.params,
                        item.params,
                        default_max_tokens=self.settings.default_max_tokens,
                        effort_budgets=self.settings.reasoning_effort_budgets,
                    )
                else:
                    if shared is None:
                        try:
                            shared = resolve_sampling(
                                handle.params,
                                None,
                                default_max_tokens=self.settings.default_max_tokens,
                                effort_budgets=self.settings.reasoning_effort_budgets,
                            )
                        except Exception as error:  # noqa: BLE001 - each item is refused below
                            shared = error
                    if isinstance(shared, Exception):
                        raise shared
                    own = shared
                sampling.append(own)
                items.append(item)
            except Exception as error:  # noqa: BLE001 - a stored value the worker cannot use
                outcomes.append(
                    Outcome(None, item, handle, OutcomeKind.rejected, code="invalid_request",
                            message=f"invalid sampling parameters: {_message(error)}")
                )  # fmt: skip
        start = time.thread_time()
        prepared = self.prepare(items, sampling)
        prepare_s = time.thread_time() - start
        clock.add("prepare", prepare_s)
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
                    Outcome(None, item, handle, OutcomeKind.rejected, code=ready.code,
                            message=ready.message)
                )  # fmt: skip
            elif isinstance(ready, _Raised):
                kind = OutcomeKind.rejected if blamed else OutcomeKind.error
                outcomes.append(
                    Outcome(None, item, handle, kind, code="invalid_request",
                            message=_message(ready.error))
                )  # fmt: skip
            else:
                flights.append(
                    Flight(claimed=item, prepared=ready, handle=handle, started=now,
                           quarantined=suspects)
                )  # fmt: skip
        return flights, outcomes, prepare_s

    def prepare(
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
