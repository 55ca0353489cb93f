"""The runner in-process with the fake engine: saturation, fairness, cancel, expiry, timeouts."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa

from tests.helpers import check_invariants
from tests.helpers import rollbacks_that_drop_prepared_statements
from tests.helpers import seed_job
from tests.helpers import submit_job
from tests.helpers import wait_until
from tests.runner_harness import Harness
from tests.runner_harness import close_runner
from tests.runner_harness import job_row
from tests.runner_harness import sampled
from tests.runner_harness import wait_status
from thinkbatch.settings import Settings
from worker.engine import create_engine
from worker.runner import Runner
from worker.runner.core import PROGRESS_INTERVAL_S


def test_a_job_runs_to_completion_with_the_engine_kept_full(harness: Harness) -> None:
    runner = harness.runner()
    job_id = seed_job(harness.db, harness.settings, n=400)
    engine: Any = runner.engine
    with sampled(lambda: len(engine._running) + len(engine._waiting)) as depth:
        thread, reports = harness.drive(runner, job_id)
        thread.join(60)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 400
    check_invariants(harness.db, job_id)
    outcome = reports[-1]
    assert outcome["done"] == 400 and outcome["pending"] == 0
    progress = [r for r in reports[:-1]]
    assert progress == sorted(progress) and progress[-1] == (400, 400)
    # Continuous batching: while most of the job remained, the engine held more than a
    # full batch (max_num_seqs) at nearly every sample, i.e. it never drained between claims.
    busy = depth[: len(depth) * 2 // 3]
    full = sum(d >= harness.settings.max_num_seqs for d in busy) / len(busy)
    # The runner keeps at least 2 x max_num_seqs items in the engine, so a full batch waits
    # behind the running one, and a fake item lives for tens of 2 ms steps: the engine drops
    # below a full batch only when one refill (a claim and its preparing) takes longer than a
    # whole batch takes to finish. Load slows the engine's steps (same process) about as much
    # as the claimer, but not exactly: the claimer's round trips go through Postgres, which
    # other processes load too. 90 % failed once at load 4.7 on this 2-core host (0.887, with
    # other test suites running) and holds when idle; 75 % keeps room for that and still says
    # the engine was full for three quarters of the job.
    assert full > 0.75, full
    assert max(depth) <= harness.settings.inflight_window_most


# slow: fairness needs the big job (1,500 items) still running seconds after the small one
# finished; ~8 s of engine time on this host.
@pytest.mark.slow
def test_a_small_job_is_not_starved_by_a_big_one(harness: Harness) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.004})
    big = seed_job(harness.db, harness.settings, n=1500)
    big_thread, _ = harness.drive(runner, big)
    time.sleep(0.5)
    small = seed_job(harness.db, harness.settings, n=40, priority=3)
    small_thread, _ = harness.drive(runner, small)
    small_thread.join(60)
    small_done = job_row(harness.db, small)
    big_progress = job_row(harness.db, big)
    assert small_done.status == "completed"
    assert big_progress.status == "running" and big_progress.pending > 0
    big_thread.join(120)
    check_invariants(harness.db, big)
    check_invariants(harness.db, small)


def test_two_workers_split_one_job_without_duplicates(harness: Harness) -> None:
    a, b = harness.runner(), harness.runner()
    job_id = seed_job(harness.db, harness.settings, n=600)
    ta, _ = harness.drive(a, job_id)
    tb, _ = harness.drive(b, job_id)
    ta.join(60)
    tb.join(60)
    check_invariants(harness.db, job_id)
    with harness.db.connect() as conn:
        per_worker = dict(
            conn.execute(
                sa.text("SELECT worker_id, count(*) FROM item_results GROUP BY worker_id")
            ).all()
        )
    assert set(per_worker) == {a.owner, b.owner}
    assert min(per_worker.values()) > 100  # both did a real share


def results_per_worker(db: sa.Engine, job_id: uuid.UUID) -> dict[str, int]:
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT r.worker_id, count(*) FROM item_results r JOIN items i ON i.id = r.item_id"
                " WHERE i.job_id = :id GROUP BY r.worker_id"
            ),
            {"id": job_id},
        ).all()
    return dict(rows)  # type: ignore[arg-type]


def test_an_idle_worker_pulls_a_share_of_a_job_it_got_no_hint_for(harness: Harness) -> None:
    # Redis gave every hint of the job to worker a; b, idle, finds the job in Postgres.
    a = harness.runner(engine_extra_args={"step_s": 0.004})
    job_id = seed_job(harness.db, harness.settings, n=800)
    foreign = seed_job(harness.db, harness.settings, n=5)
    with harness.db.begin() as conn:  # a job for workers that serve another model
        conn.execute(
            sa.text("UPDATE jobs SET model = 'someone/else' WHERE id = :id"), {"id": foreign}
        )
    ta, _ = harness.drive(a, job_id)
    adopted: list[uuid.UUID] = []
    threads: list[threading.Thread] = []
    started = threading.Event()

    def to_self(jid: uuid.UUID) -> bool:  # what the worker's own Celery queue would do
        started.wait(10)  # b's housekeeper may look before harness.runner() has returned b
        adopted.append(jid)
        threads.append(harness.drive(b, jid)[0])
        return True

    b = harness.runner(publish_here=to_self, heartbeat_s=0.1, engine_extra_args={"step_s": 0.004})
    started.set()
    ta.join(60)
    for thread in threads:
        thread.join(60)
    check_invariants(harness.db, job_id)
    assert adopted == [job_id]  # once, and never the job of a model it does not serve
    shares = results_per_worker(harness.db, job_id)
    assert set(shares) == {a.owner, b.owner} and min(shares.values()) > 100, shares
    assert job_row(harness.db, foreign).status == "queued"


def test_a_slice_hands_the_job_on_before_its_tail_drains(harness: Harness) -> None:
    handoffs: list[int] = []
    threads: list[threading.Thread] = []

    def hand_on(jid: uuid.UUID) -> bool:  # the next task lands on this same worker
        handoffs.append(runner.inflight.count)  # what the engine held at hand-off
        threads.append(harness.drive(runner, jid)[0])
        return True

    runner = harness.runner(publish=hand_on, task_slice_s=0.3, engine_extra_args={"step_s": 0.004})
    job_id = seed_job(harness.db, harness.settings, n=600)
    threads.append(harness.drive(runner, job_id)[0])
    # Each slice starts the next thread before it ends, so join until none is left, bounded.
    wait_until(lambda: not any(t.is_alive() for t in threads), 120, "every slice ended", 0.05)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 600
    check_invariants(harness.db, job_id)
    assert len(handoffs) >= 2
    # No drain at a slice boundary: a runner that waited for its tail would hand on with
    # nothing in the engine, so every hand-off must find items there. "Full at every hand-off"
    # (min >= max_num_seqs) is not a safe bound on a loaded 2-core host: the claimer refills
    # the window between the engine's steps, and a hand-off that lands in one of its lags (the
    # < 10 % of samples test_a_job_runs_to_completion_with_the_engine_kept_full allows) reads
    # a part batch; it failed so at load 8 ([16, 32, 24, ...] with one below 16). Full at
    # most hand-offs (the median) still tells a tail handed on from a tail drained.
    assert min(handoffs) > 0, handoffs
    assert sorted(handoffs)[len(handoffs) // 2] >= harness.settings.max_num_seqs, handoffs


def test_cancel_mid_job(harness: Harness, client) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.01})
    job_id = seed_job(harness.db, harness.settings, n=300)
    thread, _ = harness.drive(runner, job_id)
    wait_until(lambda: job_row(harness.db, job_id).succeeded >= 20, 30, "20 items done")
    response = client.post(f"/v1/jobs/{job_id}/cancel")
    assert response.status_code == 200
    assert response.json["status"] in ("cancelling", "cancelled")
    assert response.json["counts"]["pending"] == 0  # pending items end at once
    thread.join(30)
    row = wait_status(harness.db, job_id, {"cancelled"})
    counts = check_invariants(harness.db, job_id)
    assert counts["succeeded"] >= 20 and counts["cancelled"] > 0
    assert row.succeeded + row.cancelled == 300
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
    lines = client.get(f"/v1/jobs/{job_id}/results?status=succeeded").data.splitlines()
    assert len(lines) == counts["succeeded"]  # partial results stay downloadable


def test_expiry_mid_job(harness: Harness) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.01})
    job_id = seed_job(harness.db, harness.settings, n=300, completion_window=2)
    thread, _ = harness.drive(runner, job_id)
    thread.join(30)
    row = wait_status(harness.db, job_id, {"expired"})
    counts = check_invariants(harness.db, job_id)
    assert counts["expired"] > 0 and counts["succeeded"] > 0
    assert row.finished_at is not None


def test_a_hung_item_times_out_and_the_rest_finish(harness: Harness) -> None:
    runner = harness.runner(item_deadline_s=1.0, lease_s=5, max_attempts=2)
    spec_items = [{"custom_id": f"i{k}", "prompt": f"p {k}"} for k in range(30)]
    spec_items[7] = {"custom_id": "hang", "prompt": "[[hang]] forever"}

    job_id = submit_job(harness.db, harness.settings, {"items": spec_items})
    thread, _ = harness.drive(runner, job_id)
    thread.join(30)
    counts = check_invariants(harness.db, job_id)
    assert (counts["succeeded"], counts["failed"]) == (29, 1)
    with harness.db.connect() as conn:
        hang = conn.execute(
            sa.text("SELECT attempts, error_code FROM items WHERE custom_id = 'hang'")
        ).one()
    assert tuple(hang) == (2, "timeout")


def test_graceful_shutdown_releases_items(harness: Harness) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.02})
    job_id = seed_job(harness.db, harness.settings, n=200)
    thread, reports = harness.drive(runner, job_id)
    wait_until(lambda: job_row(harness.db, job_id).succeeded >= 10, 30, "10 items done")
    runner.begin_shutdown()
    thread.join(10)
    assert not thread.is_alive()
    row = job_row(harness.db, job_id)
    assert row.running == 0 and row.pending > 0  # released, not lost
    # Handed on to another worker (the sweeper may re-hint it too when the host is slow).
    assert harness.published and set(harness.published) == {job_id}
    with harness.db.connect() as conn:
        refunded = conn.execute(
            sa.text("SELECT count(*) FROM items WHERE status = 'pending' AND attempts > 0")
        ).scalar()
    assert refunded == 0  # a graceful release costs no attempt
    check_invariants(harness.db, job_id, finished=False)


def test_a_big_claim_is_rendered_and_launched_in_slices(harness: Harness) -> None:
    # 64 sequences: a window of 128 items, launched 16 at a time.
    runner = harness.runner(max_num_seqs=64)
    claims: list[int] = []
    sizes: list[int] = []
    prepare, claim_into = runner.engine.prepare, runner.claimer.claim_into

    def recording(items, sampling):
        sizes.append(len(items))
        return prepare(items, sampling)

    def claiming(handle, n, *, suspects):
        claims.append(n)
        return claim_into(handle, n, suspects=suspects)

    runner.engine.prepare = recording  # type: ignore[method-assign]
    runner.claimer.claim_into = claiming  # type: ignore[method-assign]
    job_id = seed_job(harness.db, harness.settings, n=100)
    thread, _ = harness.drive(runner, job_id)
    thread.join(60)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 100
    check_invariants(harness.db, job_id)
    assert sum(sizes) == 100
    chunk = runner.claimer.launch_chunk
    assert runner.window > chunk
    # An idle engine's first claim is one slice, so the engine starts on it at once; the
    # second fills the rest of the window in one round trip, and reaches the engine in slices.
    assert claims[0] == chunk, claims
    assert claims[1] == runner.window - chunk, claims
    assert sizes[0] == chunk and max(sizes) <= chunk, sizes


def _window_while(harness: Harness, runner: Runner, job_id: uuid.UUID) -> tuple[int, int]:
    """Drive the job to completion; the largest window size and item count seen meanwhile."""
    with sampled(lambda: (runner.inflight.size, runner.inflight.count)) as seen:
        thread, _ = harness.drive(runner, job_id)
        thread.join(120)
    check_invariants(harness.db, job_id)
    return max(s for s, _ in seen), max(c for _, c in seen)


def test_the_window_grows_while_the_engine_finishes_items_fast(harness: Harness) -> None:
    # Tokens at no cost: the engine empties a window at rest (2 x 16 items) many times within
    # INFLIGHT_LOOKAHEAD_S, so the window grows towards its most, and no further.
    runner = harness.runner(engine_extra_args={"step_s": 0})
    job_id = seed_job(harness.db, harness.settings, n=3000)
    size, count = _window_while(harness, runner, job_id)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 3000
    assert runner.window < size <= runner.inflight.most == harness.settings.inflight_window_most
    assert count <= runner.inflight.most


def test_the_window_stays_at_rest_for_items_slower_than_its_lookahead(harness: Harness) -> None:
    # 8 steps of 50 ms: a batch of 16 takes 0.4 s, so 0.25 s of the engine's output is ~10
    # items, fewer than the window at rest holds.
    runner = harness.runner(engine_extra_args={"step_s": 0.05})
    job_id = seed_job(harness.db, harness.settings, n=64, params={"max_tokens": 8})
    size, count = _window_while(harness, runner, job_id)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 64
    assert size == runner.window and count <= runner.window


def test_a_slow_job_keeps_to_the_window_at_rest_beside_a_fast_one(harness: Harness) -> None:
    # Job a's items take one 2 ms step and grow the window; job b's take 200 steps (0.4 s, more
    # than INFLIGHT_LOOKAHEAD_S). Its fair half of the grown window would lease b more than the
    # window at rest holds; b keeps to that.
    runner = harness.runner()
    quick, long = {"ignore_eos": True, "max_tokens": 1}, {"ignore_eos": True, "max_tokens": 200}
    fast = seed_job(harness.db, harness.settings, n=6000, params=quick)
    slow = seed_job(harness.db, harness.settings, n=64, params=long)
    thread_a, _ = harness.drive(runner, fast)
    wait_until(lambda: runner.inflight.size > 2 * runner.window, 30, "the window grew")

    def slow_held() -> tuple[int, int] | None:
        handle = runner.inflight.handles.get(slow)
        return None if handle is None else (runner.inflight.size, handle.job_inflight())

    with sampled(slow_held, every_s=0.002) as held:
        thread_b, _ = harness.drive(runner, slow)
        thread_b.join(60)
        thread_a.join(60)
    assert wait_status(harness.db, slow, {"completed"}).succeeded == 64
    assert wait_status(harness.db, fast, {"completed"}).succeeded == 6000
    check_invariants(harness.db, slow)
    check_invariants(harness.db, fast)
    assert max(size for size, _ in held) > 2 * runner.window, "a grown window was shared"
    assert max(n for _, n in held) <= runner.window, held


def test_results_are_stored_once_the_engine_empties_not_at_the_write_interval(
    harness: Harness,
) -> None:
    # A write interval far longer than the job: the writer must not sit on the last results.
    runner = harness.runner(write_interval_s=60)
    job_id = seed_job(harness.db, harness.settings, n=50)
    started = time.monotonic()
    thread, reports = harness.drive(runner, job_id)
    thread.join(30)
    assert not thread.is_alive()
    assert wait_status(harness.db, job_id, {"completed"}, timeout=1).succeeded == 50
    assert time.monotonic() - started < 30
    check_invariants(harness.db, job_id)


def test_a_handed_over_job_counts_its_predecessors_tail_in_its_share(settings: Settings) -> None:
    from worker.runner import JobHandle

    runner = Runner(settings, engine=create_engine(settings), db=None, publish=lambda j: True)  # type: ignore[arg-type]
    job_a, job_b = uuid.uuid4(), uuid.uuid4()
    # Job a's slice ended with half the window still in the engine; its successor has claimed
    # nothing yet. Job b, of the same weight, has nothing in the engine.
    tail = JobHandle(job_id=job_a, weight=1, params={}, inflight=runner.window // 2)
    successor = JobHandle(job_id=job_a, weight=1, params={}, predecessor=tail)
    other = JobHandle(job_id=job_b, weight=1, params={})
    picked, n = runner.claimer.pick([successor, other], free=runner.window // 2)
    assert picked is other, "job a already holds its share through the predecessor's tail"
    assert successor.job_inflight() == runner.window // 2
    tail.inflight = 0  # the tail drained: the successor lets go of it
    assert successor.job_inflight() == 0 and successor.predecessor is None
    close_runner(runner)


def test_the_last_progress_report_of_a_finished_job_is_final(harness: Harness) -> None:
    """Flower shows a task's last PROGRESS: done must equal total once the job is complete,
    even when the last results are stored while the task is reading the job's state."""
    runner = harness.runner()

    def slowly(read: Callable[[uuid.UUID], Any]) -> Callable[[uuid.UUID], Any]:
        def read_then_wait(job_id: uuid.UUID) -> Any:
            state = read(job_id)
            time.sleep(0.3)  # results stored meanwhile are not in `state`
            return state

        return read_then_wait

    runner._job_state = slowly(runner._job_state)  # type: ignore[method-assign]
    runner._heartbeat_job = slowly(runner._heartbeat_job)  # type: ignore[method-assign]
    for n in (1, 20, 40, 60):
        job_id = seed_job(harness.db, harness.settings, n=n)
        thread, reports = harness.drive(runner, job_id)
        thread.join(30)
        assert wait_status(harness.db, job_id, {"completed"}).succeeded == n
        progress = reports[:-1]
        assert progress and progress[-1] == (n, n), (n, progress)


def test_the_engine_is_shared_equally_between_tenants_then_by_priority() -> None:
    from worker.runner import JobHandle
    from worker.runner import fair_shares

    many = [JobHandle(job_id=uuid.uuid4(), weight=w, params={}, tenant="big") for w in (1, 1, 10)]
    one = JobHandle(job_id=uuid.uuid4(), weight=1, params={}, tenant="small")
    shares = fair_shares(512, [*many, one])
    assert shares[one] == 256  # one job of one tenant: half, however many jobs the other has
    assert sum(shares[h] for h in many) == 256
    assert shares[many[2]] == pytest.approx(10 * shares[many[0]])  # priority: within a tenant


# slow: three 800-item jobs must contend for seconds, then all 2,600 items run to the end for
# the invariants; ~14 s of engine time on this host.
@pytest.mark.slow
def test_a_tenant_with_many_jobs_does_not_hold_back_another(harness: Harness) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.004})
    big_jobs = [seed_job(harness.db, harness.settings, n=800, tenant="big") for _ in range(3)]
    threads = [harness.drive(runner, job_id)[0] for job_id in big_jobs]
    time.sleep(0.5)
    small = seed_job(harness.db, harness.settings, n=200, tenant="small")
    small_thread, _ = harness.drive(runner, small)
    held: list[int] = []  # the small tenant's items in the engine, sampled while it runs
    deadline = time.monotonic() + 60
    while small_thread.is_alive():
        assert time.monotonic() < deadline, "the small job did not finish within 60 s"
        handle = runner.inflight.handles.get(small)
        if handle is not None:
            held.append(handle.job_inflight())
        time.sleep(0.01)
    assert job_row(harness.db, small).status == "completed"
    # Half the window, as the only other tenant's share; per job it would be a quarter. Both
    # bounds here compare shares of one engine, which load slows for both tenants alike: the
    # first needs one sample of the steady half at 0.4 x window, and at an equal share the big
    # tenant does about as many items as the small job's 200 meanwhile, far from the 1,200 of
    # its 2,400 that the second bound allows.
    steady = sorted(held)[len(held) // 2 :]
    assert max(steady) >= 0.4 * runner.window, (runner.window, steady[-20:])
    left = sum(job_row(harness.db, j).pending for j in big_jobs)
    assert left > 1200, f"the big tenant was nearly done ({left} pending) before the small job"
    for thread in threads:
        thread.join(180)
    for job_id in [*big_jobs, small]:
        check_invariants(harness.db, job_id)


# slow: the tenant's two 300-item jobs must hold their slots while a third is refused, then
# all three run to the end; ~5 s of engine time on this host.
@pytest.mark.slow
def test_a_tenant_may_hold_only_so_many_task_threads(harness: Harness) -> None:
    runner = harness.runner(engine_extra_args={"step_s": 0.004}, tenant_max_jobs_per_worker=2)
    jobs = [seed_job(harness.db, harness.settings, n=300, tenant="big") for _ in range(3)]
    first = [harness.drive(runner, job_id) for job_id in jobs[:2]]
    time.sleep(0.3)
    third_thread, third = harness.drive(runner, jobs[2])
    third_thread.join(5)  # returns at once: the tenant holds its two slots
    assert third[-1]["outcome"] == "not runnable here"
    other = seed_job(harness.db, harness.settings, n=20, tenant="other")
    other_thread, _ = harness.drive(runner, other)
    other_thread.join(60)
    assert job_row(harness.db, other).status == "completed"
    for thread, _ in first:
        thread.join(120)
    # Nothing is lost: the refused job runs once a slot is free.
    later_thread, _ = harness.drive(runner, jobs[2])
    later_thread.join(120)
    assert job_row(harness.db, jobs[2]).status == "completed"


def test_a_task_reads_its_jobs_state_by_the_clock_not_by_the_stored_batch(
    harness: Harness,
) -> None:
    """The task driving a job reads the job's state (a query) each time it wakes. It wakes
    every PROGRESS_INTERVAL_S and when nothing of its own is left unsettled, not after every
    batch the writer stores: at short outputs that was tens of queries a second."""
    runner = harness.runner(write_interval_s=0.02)  # many small batches
    reads: list[float] = []
    batches: list[int] = []

    def counted(read: Callable[[uuid.UUID], Any]) -> Callable[[uuid.UUID], Any]:
        def read_and_count(job_id: uuid.UUID) -> Any:
            reads.append(time.monotonic())
            return read(job_id)

        return read_and_count

    persist = runner.writer.persist

    def persist_and_count(batch: list[Any]) -> None:
        batches.append(len(batch))
        persist(batch)

    runner._job_state = counted(runner._job_state)  # type: ignore[method-assign]
    runner._heartbeat_job = counted(runner._heartbeat_job)  # type: ignore[method-assign]
    runner.writer.persist = persist_and_count  # type: ignore[method-assign]
    job_id = seed_job(harness.db, harness.settings, n=600)
    started = time.monotonic()
    thread, reports = harness.drive(runner, job_id)
    thread.join(60)
    elapsed = time.monotonic() - started
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 600
    assert reports[:-1][-1] == (600, 600)  # the last report is still final
    # The writer stored many batches; the task read the job's state about once a second, plus
    # a read for each time its items all settled (which may happen between claims).
    assert len(batches) >= 20, batches
    drains = len(reads) - elapsed / PROGRESS_INTERVAL_S
    assert len(reads) < len(batches) / 2, (len(reads), len(batches), elapsed)
    assert drains <= len(batches) / 4, (len(reads), len(batches), elapsed)
    check_invariants(harness.db, job_id)


def test_no_read_of_a_worker_drops_its_connections_prepared_statements(harness: Harness) -> None:
    """psycopg drops every prepared statement of a connection when a transaction on it rolls
    back, and the claims and stores that connection served are then planned again for each
    execution until prepared anew (thinkbatch.db.reads). Nothing a worker does while it runs a
    job, and sweeps meanwhile, rolls back a transaction it opened."""
    main = threading.main_thread()

    def worker_thread() -> str | None:  # the test's own reads, on the main thread, do not count
        current = threading.current_thread()
        return None if current is main else current.name

    with rollbacks_that_drop_prepared_statements(harness.db, worker_thread) as dropping:
        # Sweeps every half second, so that the housekeeper's passes fall within the job.
        runner = harness.runner(sweep_interval_s=0.5)
        job_id = seed_job(harness.db, harness.settings, n=400)
        thread, _ = harness.drive(runner, job_id)
        thread.join(60)
        assert wait_status(harness.db, job_id, {"completed"}).succeeded == 400
    assert not dropping, "\n".join(dropping)
