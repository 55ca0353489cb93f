"""The writer: stores what came out of the engine in batches, one fenced transaction per batch,
off the engine's path."""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from dataclasses import field
from typing import Any

import sqlalchemy as sa

from thinkbatch import ledger
from thinkbatch.answers import AnswerInvalid
from thinkbatch.answers import parse_answer
from thinkbatch.db import retry_transient
from thinkbatch.ledger import Claimed
from thinkbatch.ledger import Done
from thinkbatch.ledger import Failed
from thinkbatch.models import ItemStatus
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings
from thinkbatch.thinking import ThinkingSplit
from thinkbatch.thinking import count_reasoning_tokens
from thinkbatch.thinking import split_thinking
from thinkbatch.thinking import thinking_truncated
from worker.engine import Engine
from worker.engine import Generation
from worker.engine import Prepared
from worker.engine import ThinkTokens
from worker.metrics import metrics
from worker.runner.suspects import Suspects
from worker.runner.window import AbortReason
from worker.runner.window import Flight
from worker.runner.window import InFlight
from worker.runner.window import JobHandle
from worker.stages import clock

log = logging.getLogger(__name__)

Key = tuple[int, uuid.UUID, int]  # an item's fence: id, job, attempt


class OutcomeKind(enum.StrEnum):
    done = "done"  # a generation to store
    rejected = "rejected"  # the item's own fault: fails now
    error = "error"  # ours or the engine's: retried until MAX_ATTEMPTS
    aborted = "aborted"  # taken out of the engine; AbortReason says why


@dataclass(slots=True)  # not frozen: one per item (see ledger.Claimed)
class Outcome:
    flight: Flight | None
    claimed: Claimed
    handle: JobHandle
    kind: OutcomeKind
    generation: Generation | None = None
    reason: AbortReason | None = None  # kind aborted only
    code: str = ""  # kinds rejected and error: the item's error code
    message: str = ""


@dataclass
class Writes:
    """One batch of outcomes sorted into the ledger's writes."""

    done: list[Done] = field(default_factory=list)
    failed: list[Failed] = field(default_factory=list)
    ended: dict[ItemStatus, list[Key]] = field(
        default_factory=lambda: {ItemStatus.cancelled: [], ItemStatus.expired: []}
    )
    released: list[Key] = field(default_factory=list)


@dataclass(frozen=True)
class Refused:
    """Writes of one batch that the fence turned away, by kind: the items' leases had passed
    on (lapsed, or released when this worker was judged dead) before the writes arrived."""

    results: int = 0
    failures: int = 0
    ends: int = 0
    releases: int = 0

    @property
    def total(self) -> int:
        return self.results + self.failures + self.ends + self.releases

    def by_kind(self) -> dict[str, int]:
        return {
            "result": self.results,
            "failure": self.failures,
            "end": self.ends,
            "release": self.releases,
        }


def refused(writes: Writes, applied: dict[str, Any]) -> Refused:
    """What the fence refused of `writes`, from what each fenced write reports it applied."""
    return Refused(
        results=len(writes.done) - len(applied.get("done", ())),
        failures=len(writes.failed) - len(applied.get("failed", {})),
        ends=sum(len(keys) for keys in writes.ended.values()) - applied.get("ended", 0),
        releases=len(writes.released) - applied.get("released", 0),
    )


# What an abort means for the item's record.
_ENDS = {AbortReason.cancelled: ItemStatus.cancelled, AbortReason.expired: ItemStatus.expired}


def sort_outcomes(batch: list[Outcome], *, think: ThinkTokens, item_deadline_s: float) -> Writes:
    """The batch's writes. An outcome whose result cannot be built (an exception no check
    foresaw, in parsing its answer say) fails that item alone, retried up to MAX_ATTEMPTS:
    raised here, it would end the writer's thread, and no result of this worker would be
    stored again."""
    writes = Writes()
    for outcome in batch:
        try:
            _sort(writes, outcome, think, item_deadline_s)
        except Exception as error:  # confined to its item, and logged
            item = outcome.claimed
            log.exception("could not build the result of item %d", item.id)
            message = f"the worker could not build this item's result ({type(error).__name__})"
            key = (item.id, item.job_id, item.attempt)
            writes.failed.append(Failed(*key, "internal_error", message, retryable=True))
    return writes


def _sort(writes: Writes, outcome: Outcome, think: ThinkTokens, item_deadline_s: float) -> None:
    item = outcome.claimed
    key = (item.id, item.job_id, item.attempt)
    match outcome.kind:
        case OutcomeKind.done:
            assert outcome.generation is not None and outcome.flight is not None
            stored = to_done(item, outcome.flight.prepared, outcome.generation, think)
            if isinstance(stored, Done):
                writes.done.append(stored)
            else:
                writes.failed.append(stored)
        case OutcomeKind.rejected:
            writes.failed.append(Failed(*key, outcome.code, outcome.message, retryable=False))
        case OutcomeKind.error:
            writes.failed.append(Failed(*key, outcome.code, outcome.message, retryable=True))
        case OutcomeKind.aborted if outcome.reason in _ENDS:
            writes.ended[_ENDS[outcome.reason]].append(key)
        case OutcomeKind.aborted if outcome.reason is AbortReason.deadline:
            message = f"no result within ITEM_DEADLINE_S={item_deadline_s:g}s"
            writes.failed.append(Failed(*key, "timeout", message, retryable=True))
        case _:  # shutdown
            writes.released.append(key)


def _rich(sampling: Sampling) -> bool:
    """Whether an item's result needs its choices stored as records (see Done.choices)."""
    structured = sampling.structured
    return (
        sampling.n > 1
        or sampling.logprobs is not None
        or sampling.tool_mode != "none"
        or (structured is not None and structured.json_answer)
    )


def _answer_logprobs(
    gen: Generation, reasoning_tokens: int, split: ThinkingSplit
) -> list[dict[str, Any]]:
    """The logprobs of the answer's tokens: those after the thinking, less
    - the tokens that spell the line breaks between `</think>` and the answer (`separator`,
      which the answer's text does not hold either), and
    - the tokens past the answer's end: the end-of-text token that detokenizing drops, and
      those of a stop string or stop token the engine cut from the text but not from its
      logprobs (`include_stop_str_in_output` false, the default).
    The tokens' bytes then join to the answer's, unless a token spans the answer's edge (holds
    both separator and answer text, or both answer and stop string): it stays, whole."""
    entries = (gen.logprobs or [])[reasoning_tokens:]
    separator = split.separator
    skip = 0
    while skip < len(entries) and separator:
        token = entries[skip].get("token", "")
        if not token or not separator.startswith(token):
            break
        separator = separator[len(token) :]
        skip += 1
    entries = entries[skip:]
    size = len(split.answer.encode())
    # Every engine's entries carry their token's bytes (worker.engine.token_logprob).
    total = sum(len(e["bytes"]) for e in entries)
    while entries and total - len(entries[-1]["bytes"]) >= size:
        total -= len(entries[-1]["bytes"])
        entries = entries[:-1]
    return entries


def _choice(
    item: Claimed, prepared: Prepared, gen: Generation, think: ThinkTokens, index: int
) -> dict[str, Any]:
    split = split_thinking(gen.text, opened_in_prompt=prepared.opened_in_prompt)
    reasoning = count_reasoning_tokens(
        gen.token_ids,
        start_id=think.start_id,
        end_id=think.end_id,
        opened_in_prompt=prepared.opened_in_prompt,
    )
    sampling = prepared.sampling
    truncated = thinking_truncated(
        split, reasoning_tokens=reasoning, budget=sampling.thinking_budget
    )
    record: dict[str, Any] = {
        "thinking": split.thinking,
        "answer": split.answer,
        "finish_reason": gen.finish_reason,
        "thinking_truncated": truncated,
        "completion_tokens": len(gen.token_ids),
        "reasoning_tokens": reasoning,
    }
    if not _rich(sampling):
        return record
    try:
        parsed = parse_answer(split.answer, sampling, f"call_{item.id:x}_{index}")
    except AnswerInvalid as error:
        # Cut by the request's own limits, an answer is cut again on a retry: only an answer
        # the model ended itself may come out whole on another attempt.
        if gen.finish_reason == "length":
            why = " (cut by max_tokens: raise it)"
        elif gen.stop_reason is not None:
            kind = "string" if isinstance(gen.stop_reason, str) else "token"
            why = f" (cut by the stop {kind} {gen.stop_reason!r})"
        else:
            why = ""
        raise _Invalid(f"choice {index}: {error}{why}", retryable=not why) from None
    record["answer"] = parsed.content
    if parsed.tool_calls:
        record["tool_calls"] = parsed.tool_calls
        record["finish_reason"] = "tool_calls"
    if parsed.is_json:
        record["json"] = True
    if sampling.logprobs is not None:
        record["logprobs"] = _answer_logprobs(gen, reasoning, split)
    return record


class _Invalid(Exception):
    def __init__(self, message: str, *, retryable: bool):
        super().__init__(message)
        self.message = message
        self.retryable = retryable


def to_done(
    item: Claimed, prepared: Prepared, gen: Generation, think: ThinkTokens
) -> Done | Failed:
    """The result to store: every choice split into thinking and answer, the answer held to
    its constraint. An answer that breaks its promise (not the JSON its schema asks for, as
    when max_tokens cut it) fails the item instead, as `answer_invalid`: what is stored is
    always what the request was promised."""
    try:
        records = [_choice(item, prepared, g, think, i) for i, g in enumerate(gen.choices())]
    except _Invalid as error:
        return Failed(
            item.id, item.job_id, item.attempt, "answer_invalid", error.message, error.retryable
        )
    first = records[0]
    return Done(
        item_id=item.id,
        job_id=item.job_id,
        attempt=item.attempt,
        thinking=first["thinking"],
        answer=first["answer"],
        finish_reason=first["finish_reason"],
        thinking_truncated=first["thinking_truncated"],
        prompt_tokens=gen.prompt_tokens,
        completion_tokens=sum(r["completion_tokens"] for r in records),
        reasoning_tokens=sum(r["reasoning_tokens"] for r in records),
        choices=records if _rich(prepared.sampling) else None,
    )


class Writer:
    def __init__(
        self,
        settings: Settings,
        db: sa.Engine,
        owner: str,
        engine: Engine,
        inflight: InFlight,
        suspects: Suspects,
        dead: threading.Event,
        finished: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.db = db
        self.owner = owner
        self.engine = engine  # its think tokens are known once it has started
        self.inflight = inflight
        self.suspects = suspects
        self.dead = dead
        # Set when a store finished a job: the housekeeper then makes a batch's output files.
        self.finished = finished or threading.Event()
        self._outcomes: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()
        self._stored_at = 0.0  # when the last batch was stored (monotonic)

    def put(self, outcome: Outcome) -> None:
        self._outcomes.put(outcome)

    def idle(self) -> bool:
        """Nothing waits to be stored (a batch being written may still be in progress)."""
        return self._outcomes.empty()

    def finish(self) -> None:
        """Store what is queued, then stop."""
        self._outcomes.put(None)

    def run(self) -> None:
        while True:
            first = self._outcomes.get()
            if first is None:
                return
            batch = [first]
            now = time.monotonic()
            # The first result after a lull (a job's first, as a rule) is stored at once, with
            # whatever came with it: a caller watching a new job sees results without waiting
            # out the batching interval. Under a steady flow batches fill as before.
            lull = now - self._stored_at >= self.settings.write_interval_s
            deadline = now + self.settings.write_interval_s
            closing = False
            while len(batch) < self.settings.write_batch_max:
                if (lull or self.inflight.count == 0) and self._outcomes.empty():
                    break  # nothing more is coming soon (the engine is empty, or a lull): store now
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
            self.persist(batch)
            self._stored_at = time.monotonic()
            if closing:
                return

    def report_refused(self, fenced: Refused) -> None:
        """Say so when the fence turned writes away: each is work of this worker that another
        attempt superseded (it was cut off, or too slow, while its leases passed on), which an
        operator should see rather than lose without a trace."""
        if not fenced.total:
            return
        kinds = fenced.by_kind()
        log.warning(
            "%d late write(s) refused by the fence: their leases had passed on (%s)",
            fenced.total,
            ", ".join(f"{n} {kind}(s)" for kind, n in kinds.items() if n),
            extra={"fenced": fenced.total, "fenced_by_kind": kinds},
        )
        metrics.fenced(kinds)

    def persist(self, batch: list[Outcome]) -> None:
        with clock.measure("parse"):
            writes = sort_outcomes(
                batch, think=self.engine.think, item_deadline_s=self.settings.item_deadline_s
            )
        start = time.thread_time()
        stored: dict[str, Any] = {}  # what the fenced writes took, for the metrics

        def write() -> None:
            with self.db.begin() as conn:
                # The batch's counts are added once, in one order of its jobs: two writers
                # whose batches end items of the same jobs never take their rows crosswise.
                counted = ledger.Counts()
                stored["done"] = ledger.complete(conn, self.owner, writes.done, counted)
                stored["failed"] = ledger.fail(
                    conn,
                    self.owner,
                    writes.failed,
                    max_attempts=self.settings.max_attempts,
                    counted=counted,
                )
                stored["ended"] = sum(
                    ledger.end_items(
                        conn,
                        self.owner,
                        keys,
                        status=status,
                        code=status.value,
                        message=f"the job was {status.value} while this item ran",
                        counted=counted,
                    )
                    for status, keys in writes.ended.items()
                )
                # Into this writer's own delta rows: the job's row, which every worker of the
                # job would otherwise lock to its commit, is left alone (ledger/counts.py).
                ledger.add_counts(conn, counted, writer=self.owner)
                stored["released"] = ledger.release(conn, self.owner, writes.released)

        def finish() -> None:
            # After the commit, so that of two writers ending a job's last items at once the
            # later one sees both (ledger.finalize_if_done).
            with self.db.begin() as conn:
                stored["finished"] = ledger.finalize_if_done(
                    conn, {o.claimed.job_id for o in batch}
                )

        try:
            retry_transient(write, should_stop=self.dead.is_set)
            metrics.stored(
                writes.done, writes.failed, stored.get("done", set()), stored.get("failed", {})
            )
            self.report_refused(refused(writes, stored))
        except Exception:  # the leases lapse and the sweeper retries the items
            log.exception("could not store %d result(s)", len(batch))
        else:
            try:
                retry_transient(finish, should_stop=self.dead.is_set)
            except Exception:  # stored all the same; the sweeper's next pass finalizes
                log.exception("could not finalize the jobs of %d stored result(s)", len(batch))
            if stored.get("finished"):
                self.finished.set()
        touched: set[JobHandle] = set()
        with self.inflight.lock:
            for outcome in batch:
                outcome.handle.unsettled -= 1
                touched.add(outcome.handle)
            drained = [handle for handle in touched if handle.unsettled == 0]
        self.suspects.left(sum(1 for o in batch if o.flight is not None and o.flight.quarantined))
        # Only a job with nothing of ours left unsettled wakes its task early (to end it, or
        # to see that it ran dry); its progress is read every PROGRESS_INTERVAL_S anyway. The
        # task reads the job's state on each wake: a wake per stored batch was a query per
        # batch, tens a second at short outputs.
        for handle in drained:
            handle.settled.set()
        self.inflight.wake.set()
        clock.add("store", time.thread_time() - start)
