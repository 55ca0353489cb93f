"""The runner's parts that need neither a database nor an engine: fair share, the writer's
sorting of outcomes (kinds and abort reasons as enums) and its batching, and the crash
suspects."""

from __future__ import annotations

import threading
import time
import uuid

from thinkbatch.ledger import Claimed
from thinkbatch.ledger import Failed
from thinkbatch.models import ItemStatus
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings
from worker.engine import Generation
from worker.engine import Prepared
from worker.engine import ThinkTokens
from worker.runner.fairness import pick
from worker.runner.suspects import Suspects
from worker.runner.window import AbortReason
from worker.runner.window import Flight
from worker.runner.window import InFlight
from worker.runner.window import JobHandle
from worker.runner.writer import Outcome
from worker.runner.writer import OutcomeKind
from worker.runner.writer import Writer
from worker.runner.writer import sort_outcomes

THINK = ThinkTokens(start_id=1, end_id=2, turn_start_id=None)


def handle(tenant: str = "t", weight: int = 1, inflight: int = 0) -> JobHandle:
    return JobHandle(
        job_id=uuid.uuid4(), weight=weight, params={}, tenant=tenant, inflight=inflight
    )


def test_pick_serves_the_job_furthest_below_its_share_within_the_chunk() -> None:
    busy, starved = handle(inflight=90), handle(inflight=0)
    inflight = {busy: 90, starved: 0}
    picked, n = pick(128, [busy, starved], inflight, free=38, chunk=32, claim_min=16)
    assert picked is starved and n == 32  # deficit 64, capped by the chunk
    picked, n = pick(128, [busy, starved], inflight, free=10, chunk=32, claim_min=16)
    assert n == 10  # never more than the room left
    fed = {busy: 60, starved: 60}
    picked, n = pick(128, [busy, starved], fed, free=8, chunk=32, claim_min=4)
    assert n == 4  # at its share: a minimal chunk, still at least claim_min


def claimed(item_id: int, job_id: uuid.UUID) -> Claimed:
    return Claimed(item_id, job_id, item_id, f"c{item_id}", None, "p", None, 2, 0)


def test_the_writer_sorts_outcomes_by_kind_and_abort_reason() -> None:
    owner = handle()
    job = owner.job_id
    items = [claimed(k, job) for k in range(7)]
    sampling = Sampling(16, 1.0, 1.0, -1, None, (), 0.0, 0.0, 1.0, True, False)
    prepared = Prepared(prompt_ids=[5], opened_in_prompt=False, sampling=sampling)
    flight = Flight(claimed=items[0], prepared=prepared, handle=owner, started=0.0)
    generation = Generation(token_ids=[1, 7, 2, 8], text="<think>x</think>y", finish_reason="stop",
                            prompt_tokens=1)  # fmt: skip
    batch = [
        Outcome(flight, items[0], owner, OutcomeKind.done, generation=generation),
        Outcome(None, items[1], owner, OutcomeKind.rejected, code="bad", message="m"),
        Outcome(None, items[2], owner, OutcomeKind.error, code="engine_error", message="m"),
        Outcome(None, items[3], owner, OutcomeKind.aborted, reason=AbortReason.cancelled),
        Outcome(None, items[4], owner, OutcomeKind.aborted, reason=AbortReason.expired),
        Outcome(None, items[5], owner, OutcomeKind.aborted, reason=AbortReason.deadline),
        Outcome(None, items[6], owner, OutcomeKind.aborted, reason=AbortReason.shutdown),
    ]
    writes = sort_outcomes(batch, think=THINK, item_deadline_s=60)
    (done,) = writes.done
    assert (done.item_id, done.thinking, done.answer, done.reasoning_tokens) == (0, "x", "y", 3)
    assert writes.failed == [
        Failed(1, job, 2, "bad", "m", retryable=False),
        Failed(2, job, 2, "engine_error", "m", retryable=True),
        Failed(5, job, 2, "timeout", "no result within ITEM_DEADLINE_S=60s", retryable=True),
    ]
    assert writes.ended == {ItemStatus.cancelled: [(3, job, 2)], ItemStatus.expired: [(4, job, 2)]}
    assert writes.released == [(6, job, 2)]


def test_suspects_wait_per_job_and_hold_the_engine_while_they_run() -> None:
    suspects = Suspects()
    a, b = handle(), handle()
    suspects.flag(a, True)
    assert suspects.waiting([a, b]) == [a] and suspects.has_waiting(a)
    suspects.flag(a, False)
    assert suspects.waiting([a, b]) == []
    suspects.entered(2)
    assert suspects.running
    suspects.left(1)
    assert suspects.running
    suspects.left(1)
    assert not suspects.running


class _Recording(Writer):
    """The writer's batching, with its fenced transaction replaced by a record of the batch."""

    def __init__(self, settings: Settings, inflight: InFlight) -> None:
        super().__init__(
            settings,
            None,
            "w",
            None,
            inflight,
            Suspects(),
            threading.Event(),  # type: ignore[arg-type]
        )
        self.batches: list[list[int]] = []
        self.stored = threading.Event()

    def persist(self, batch: list[Outcome]) -> None:
        self.batches.append([o.claimed.id for o in batch])
        self.stored.set()


def test_the_writer_stores_the_first_result_after_a_lull_at_once_then_batches() -> None:
    owner = handle()
    inflight = InFlight(8)
    inflight.add(owner, 5)  # the engine is busy: more results are coming
    writer = _Recording(Settings(write_interval_s=30, write_batch_max=1000), inflight)
    thread = threading.Thread(target=writer.run, daemon=True)
    thread.start()

    def outcome(k: int) -> Outcome:
        return Outcome(None, claimed(k, owner.job_id), owner, OutcomeKind.error, code="c")

    writer.put(outcome(1))
    # Not after WRITE_INTERVAL_S (30 s): the first result after a lull is stored at once.
    assert writer.stored.wait(10)
    writer.put(outcome(2))
    writer.put(outcome(3))
    writer.finish()  # right after a store no lull: these wait to be batched, until the finish
    thread.join(10)
    assert not thread.is_alive()
    assert writer.batches == [[1], [2, 3]]


def _leave(inflight: InFlight, owner: JobHandle, n: int, *, finished: bool = True) -> None:
    """`n` items go through the engine: in, and out again (finished, or aborted)."""
    inflight.add(owner, n)
    inflight.add(owner, -n, finished=finished)


def _window(base: int = 100, most: int = 400, lookahead_s: float = 0.25) -> InFlight:
    return InFlight(base, most=most, lookahead_s=lookahead_s)


def test_the_window_holds_its_lookahead_of_a_fast_engine_within_its_bounds() -> None:
    owner = handle()
    inflight = _window()
    inflight.handles[owner.job_id] = owner
    now = time.monotonic()  # the window's clock started just before
    step = 0.125  # a power of two: the clock's sums stay exact
    sizes = []
    # 1,200 items/s: 0.25 s of them is 300 items, between its bounds; it grows towards 300.
    for _ in range(12):
        now += step
        _leave(inflight, owner, 150)
        sizes.append(inflight.resize(now))
    assert sizes == sorted(sizes) and 100 < sizes[0] < 300, sizes
    assert 295 <= sizes[-1] <= 300, sizes
    assert inflight.allowance(owner) == inflight.size  # its own items made the pace
    # 3,200 items/s: 0.25 s of them is 800 items, more than its most; it stops at 400.
    for _ in range(8):
        now += step
        _leave(inflight, owner, 400)
        inflight.resize(now)
    assert inflight.size == 400 and inflight.rate > 3_100
    # The engine stops finishing items (long items, or none left): back to its size at rest.
    for _ in range(12):
        now += step
        inflight.resize(now)
    assert inflight.size == 100


def test_the_window_of_a_slow_engine_or_without_lookahead_stays_at_rest() -> None:
    owner = handle()
    slow, fixed, aborted = _window(), _window(lookahead_s=0.0), _window()
    now = time.monotonic()  # the windows' clocks started just before
    for _ in range(20):
        now += 0.125
        _leave(slow, owner, 30)  # 240 items/s: 0.25 s of them is 60, less than at rest
        _leave(fixed, owner, 400)  # fast, but no lookahead asked for
        _leave(aborted, owner, 400, finished=False)  # a cancel's aborts are not speed
        assert slow.resize(now) == fixed.resize(now) == aborted.resize(now) == 100
    # Sooner than RESIZE_EVERY_S after the last look, the size stays as it is.
    _leave(slow, owner, 10_000)
    assert slow.resize(now + 0.01) == 100


def test_a_job_whose_items_are_slow_keeps_to_the_window_at_rest() -> None:
    fast, slow = handle("a"), handle("b")
    inflight = _window()
    inflight.handles.update({fast.job_id: fast, slow.job_id: slow})
    now = time.monotonic()
    for _ in range(12):
        now += 0.125
        _leave(inflight, fast, 400)  # 3,200 items/s of job a; none of job b finish
        inflight.resize(now)
    assert inflight.size == 400
    assert inflight.allowance(fast) == 400 and inflight.allowance(slow) == 100
    # A job's next slice (a new handle) starts from the rate of the one it takes over from
    # (core.Runner), and counts the items that finish under it.
    successor = JobHandle(fast.job_id, 1, {}, tenant="a", predecessor=fast, rate=fast.rate)
    inflight.handles[fast.job_id] = successor
    for _ in range(4):
        now += 0.125
        _leave(inflight, fast, 400)  # the predecessor's tail
        inflight.resize(now)
    assert inflight.allowance(successor) == 400
