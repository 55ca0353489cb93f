"""Chaos scenarios against real processes: the API, Celery workers (the real vLLM CPU engine
where the engine takes part in the fault; the fake engine for the restarts of Redis and
Postgres, duplicate messages and the poison item), and private PostgreSQL and Redis servers that
get restarted. After recovery every scenario asserts: every item terminal, exactly
one result row per succeeded item, the job's counts equal a count over its items, and no item
`running` without a live lease."""

from __future__ import annotations

import signal
import threading
import time
import uuid
from datetime import UTC
from datetime import datetime
from typing import Any

import psutil
import pytest
import sqlalchemy as sa

from devstack.demo_model import DEMO_MODEL
from devstack.stack import Proc
from devstack.stack import Stack
from tests.chaos.helpers import REPORTS
from tests.chaos.helpers import Chaos
from tests.chaos.helpers import ScenarioReport
from tests.helpers import check_invariants
from tests.helpers import lost_and_duplicated
from tests.stacks import VLLM_ENV
from thinkbatch.queue import RUN_JOB
from thinkbatch.queue import make_celery
from thinkbatch.queue import model_queue
from thinkbatch.settings import Settings

pytestmark = pytest.mark.chaos

N_ITEMS = 300
# Long enough outputs that a job lasts several seconds on the tiny model, so faults land mid-job
# (with staggered(), a third of the items short so that progress is steady).
SLOW = {"ignore_eos": True, "max_tokens": 400, "temperature": 0}


def items(n: int = N_ITEMS, prefix: str = "q") -> list[dict[str, Any]]:
    return [
        {"custom_id": f"{prefix}{k}", "messages": [{"role": "user", "content": f"Question {k}?"}]}
        for k in range(n)
    ]


def staggered() -> list[dict[str, Any]]:
    """Every third item short: results arrive early and steadily instead of in whole waves, so a
    fault can land after the first results with most of the job still to run, however fast the
    engine is on the day. Every other short item asks for two choices."""
    batch = items()
    for k, item in enumerate(batch):
        item["params"] = {"max_tokens": 24 if k % 3 == 0 else 480}  # MAX_MODEL_LEN is 512
        if k % 6 == 0:
            # Two choices in flight under every fault: both are stored together, once, or
            # neither (check_invariants counts each result's choices).
            item["params"] |= {"n": 2, "temperature": 0.7}  # several choices need sampling
    return batch


def measure(chaos: Chaos, job_id: str) -> tuple[int, int]:
    """(lost, duplicated): items not terminal or succeeded without a result; extra results."""
    return lost_and_duplicated(chaos.db, job_id)


def finish(
    chaos: Chaos, name: str, job_id: str, faults: int, fault_at: datetime, note: str = ""
) -> dict[str, Any]:
    """Wait for the job, check the invariants and record the scenario's report line.

    `fault_at` is when the last fault ended (the kill, or the service coming back); recovery is
    the time from it to the first item that finished after it."""
    job = chaos.client.wait(job_id, timeout=600)
    done_at = datetime.now(UTC)
    counts = check_invariants(chaos.db, uuid.UUID(job_id))
    lost, duplicated = measure(chaos, job_id)
    with chaos.db.connect() as conn:
        first = conn.execute(
            sa.text("SELECT min(finished_at) FROM items WHERE job_id = :id AND finished_at > :t"),
            {"id": job_id, "t": fault_at},
        ).scalar()
    recover = ((first or done_at) - fault_at).total_seconds()
    REPORTS.append(
        ScenarioReport(
            name, job["counts"]["total"], faults, lost, duplicated, recover,
            (done_at - fault_at).total_seconds(), note,
        )
    )  # fmt: skip
    assert lost == 0 and duplicated == 0
    job["checked_counts"] = counts
    return job


def engine_gone(proc: Proc, timeout: float = 20) -> bool:
    """No engine process of `proc` is left alive (the reaper kills orphans)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in proc.engine_pids if psutil.pid_exists(p) and _not_zombie(p)]
        if not alive:
            return True
        time.sleep(0.5)
    return False


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def vllm_workers(chaos: Chaos, name: str) -> Stack:
    return chaos.worker_stack(name, **VLLM_ENV)


# The scenarios whose faults are the worker's links to Redis and Postgres (restarts, duplicate
# messages) run the fake engine: what they prove, that no item is lost or run twice, is the
# ledger's and the runner's, and the engine takes no part in it. Those that involve the engine
# itself (its processes after kill -9 and SIGTERM, aborts of its requests) run vLLM. 64
# sequences at 5 ms a step make a staggered job last several seconds, as vLLM does here.
FAKE_ENV = {
    "THINKBATCH_ENGINE": "fake",
    "THINKBATCH_MAX_NUM_SEQS": "64",
    "THINKBATCH_ENGINE_EXTRA_ARGS": '{"step_s": 0.005}',
}


def fake_workers(chaos: Chaos, name: str) -> Stack:
    return chaos.worker_stack(name, **FAKE_ENV)


@pytest.mark.engine
def test_kill_9_the_worker_three_times(chaos: Chaos) -> None:
    stack = vllm_workers(chaos, "kill9")
    try:
        worker = stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        fault_at = 0.0
        for k, fraction in enumerate((0.15, 0.4, 0.65)):
            chaos.client.wait(job["id"], done=int(N_ITEMS * fraction))
            worker.signal(signal.SIGKILL)
            fault_at = datetime.now(UTC)
            worker.wait(10)
            assert engine_gone(worker), f"orphan engine process after kill -9 #{k + 1}"
            worker = stack.start_worker(f"w{k + 1}")
        finish(chaos, "1. kill -9 the worker x3 (+restart)", job["id"], 3, fault_at,
               "no orphan engine")  # fmt: skip
    finally:
        stack.stop_all()


def share_by_worker(chaos: Chaos, job_id: str) -> dict[str, tuple[int, int]]:
    """worker id -> (items it holds now, results it stored) for one job."""
    with chaos.db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT w, sum(held)::int, sum(stored)::int FROM ("
                " SELECT lease_owner AS w, 1 AS held, 0 AS stored FROM items"
                "  WHERE job_id = :id AND status = 'running'"
                " UNION ALL SELECT worker_id, 0, 1 FROM item_results WHERE job_id = :id) s"
                " GROUP BY w"
            ),
            {"id": job_id},
        )
        return {worker: (held, stored) for worker, held, stored in rows}


@pytest.mark.engine
def test_two_workers_one_killed(chaos: Chaos) -> None:
    stack = vllm_workers(chaos, "two")
    try:
        a = stack.start_worker("a", wait=False)
        b = stack.start_worker("b", wait=False)
        stack.wait_worker_ready(a)
        stack.wait_worker_ready(b)
        job = chaos.client.submit(staggered(), params=SLOW)
        deadline = time.monotonic() + 180
        while True:  # both workers take part in the job, and a holds items...
            share = share_by_worker(chaos, job["id"])
            held_by_a = sum(held for w, (held, _) in share.items() if f":{a.popen.pid}:" in w)
            if len(share) >= 2 and held_by_a > 0:
                break
            assert time.monotonic() < deadline, share
            time.sleep(0.05)
        a.signal(signal.SIGKILL)  # ...when it dies: b must finish them, once each
        fault_at = datetime.now(UTC)
        note = f"{held_by_a} items held by the killed worker"
        done = finish(chaos, "2. two workers, one killed mid-job", job["id"], 1, fault_at, note)
        assert engine_gone(a)
        assert done["counts"]["succeeded"] == N_ITEMS
    finally:
        stack.stop_all()


def test_redis_restart_mid_job_and_submit_while_redis_is_down(chaos: Chaos) -> None:
    stack = fake_workers(chaos, "redis")
    try:
        stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        chaos.client.wait(job["id"], done=N_ITEMS // 5)
        chaos.redis.stop()  # this Redis keeps nothing on disk: the queues vanish
        late = chaos.client.submit(items(20, "late"), params={"max_tokens": 32})
        assert late["status"] == "queued"  # stored while Redis is down, no 500
        time.sleep(2)
        chaos.redis.start()
        fault_at = datetime.now(UTC)
        finish(chaos, "3. restart Redis mid-job (fake engine)", job["id"], 1, fault_at)
        finish(chaos, "3b. job submitted while Redis was down", late["id"], 1, fault_at)
    finally:
        stack.stop_all()


def test_postgres_restart_mid_job(chaos: Chaos) -> None:
    stack = fake_workers(chaos, "postgres")
    try:
        stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        chaos.client.wait(job["id"], done=N_ITEMS // 5)
        chaos.pg.stop()
        during = chaos.client.http.get(f"/v1/jobs/{job['id']}")
        assert during.status_code == 503, during.text  # unavailable, not a 500
        assert during.json()["error"]["code"] == "database_unavailable"
        time.sleep(3)
        chaos.pg.start()
        fault_at = datetime.now(UTC)
        finish(chaos, "4. restart Postgres mid-job (fake engine)", job["id"], 1, fault_at)
    finally:
        stack.stop_all()


def test_duplicate_deliveries(chaos: Chaos) -> None:
    stack = fake_workers(chaos, "dup")
    settings = Settings(_env_file=None, redis_url=chaos.redis.url(0))
    celery = make_celery(settings)
    queue = model_queue(settings, DEMO_MODEL)  # the workers' model's queue
    try:
        stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        chaos.client.wait(job["id"], done=N_ITEMS // 5)
        for _ in range(2):  # the same message, delivered twice more while the job runs
            celery.send_task(RUN_JOB, args=[job["id"]], queue=queue)
        fault_at = datetime.now(UTC)
        done = finish(chaos, "5. same task 3 times (fake engine)", job["id"], 2, fault_at)
        before = _snapshot(chaos, job["id"])
        celery.send_task(RUN_JOB, args=[job["id"]], queue=queue)  # once more after it finished
        time.sleep(3)
        assert _snapshot(chaos, job["id"]) == before
        assert done["counts"]["succeeded"] == N_ITEMS
    finally:
        stack.stop_all()


def _snapshot(chaos: Chaos, job_id: str) -> list[Any]:
    with chaos.db.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT i.id, i.status, i.attempts, r.created_at FROM items i "
                    "LEFT JOIN item_results r ON r.item_id = i.id WHERE i.job_id = :id "
                    "ORDER BY i.id"
                ),
                {"id": job_id},
            )
        ]


class Supervisor:
    """Restarts a worker whenever it exits, as systemd or Docker's restart policy would."""

    def __init__(self, stack: Stack, name: str):
        self.stack, self.name = stack, name
        self.restarts = 0
        self.exit_codes: list[int | None] = []
        self._stop = threading.Event()
        self.proc = stack.start_worker(name)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self.proc.alive():
                self.exit_codes.append(self.proc.popen.returncode)
                self.restarts += 1
                self.proc = self.stack.start_worker(f"{self.name}-{self.restarts}")
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_poison_item_fails_alone(chaos: Chaos) -> None:
    # The one scenario on the fault-injecting engine: a real vLLM crash cannot be planted.
    stack = chaos.worker_stack(
        "poison",
        THINKBATCH_ENGINE="fake",
        THINKBATCH_MAX_NUM_SEQS="8",
        THINKBATCH_ENGINE_EXTRA_ARGS='{"step_s": 0.01}',
    )
    batch = items(200)
    batch[57] = {"custom_id": "poison", "prompt": "[[poison]] this prompt kills the engine"}
    supervisor = Supervisor(stack, "w")
    try:
        job = chaos.client.submit(batch, params={"max_tokens": 32})
        fault_at = datetime.now(UTC)
        done = finish(
            chaos, "6. poison item (fake engine)", job["id"], 0, fault_at, "faults = crashes"
        )
        REPORTS[-1].faults = supervisor.restarts
        with chaos.db.connect() as conn:
            poison = conn.execute(
                sa.text(
                    "SELECT status, attempts, error_code FROM items WHERE custom_id = 'poison'"
                ),
            ).one()
        assert tuple(poison) == ("failed", 3, "engine_crash")
        assert done["counts"]["succeeded"] == 199 and done["counts"]["failed"] == 1
        assert set(supervisor.exit_codes) == {3}  # every exit was "engine died, restart me"
    finally:
        supervisor.stop()
        stack.stop_all()


@pytest.mark.engine
def test_sigterm_mid_job(chaos: Chaos) -> None:
    stack = vllm_workers(chaos, "sigterm")
    try:
        worker = stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        chaos.client.wait(job["id"], done=N_ITEMS // 4)
        worker.signal(signal.SIGTERM)
        fault_at = datetime.now(UTC)
        code = worker.wait(30)
        took = (datetime.now(UTC) - fault_at).total_seconds()
        assert code == 0, worker.log_text()[-3000:]
        assert took < 20, took  # SHUTDOWN_TIMEOUT_S bounds it
        assert engine_gone(worker, timeout=10), "the engine outlived a SIGTERM"
        with chaos.db.connect() as conn:
            running = conn.execute(
                sa.text("SELECT count(*) FROM items WHERE job_id = :id AND status = 'running'"),
                {"id": job["id"]},
            ).scalar_one()
        assert running == 0  # released on the way out, not left to a lease
        stack.start_worker("w2")
        finish(chaos, "7. SIGTERM mid-job (+restart)", job["id"], 1, fault_at,
               f"exit 0 in {took:.1f}s")  # fmt: skip
    finally:
        stack.stop_all()


@pytest.mark.engine
def test_cancel_and_expiry_mid_job(chaos: Chaos) -> None:
    stack = vllm_workers(chaos, "cancel")
    try:
        stack.start_worker("w")
        job = chaos.client.submit(staggered(), params=SLOW)
        chaos.client.wait(job["id"], done=N_ITEMS // 5)
        cancelled = chaos.client.http.post(f"/v1/jobs/{job['id']}/cancel").json()
        fault_at = datetime.now(UTC)
        assert cancelled["status"] in ("cancelling", "cancelled")
        assert cancelled["counts"]["pending"] == 0
        done = finish(chaos, "8a. cancel mid-job", job["id"], 1, fault_at)
        assert done["status"] == "cancelled"
        c = done["counts"]
        assert c["succeeded"] > 0 and c["cancelled"] > 0
        assert len(chaos.client.results(job["id"])) == N_ITEMS  # partial results downloadable
        assert chaos.client.http.post(f"/v1/jobs/{job['id']}/cancel").status_code == 409

        # The short items finish in the first second; the job as a whole needs ~100k tokens,
        # over 9 s on this CPU at its fastest: the window ends mid-job.
        job = chaos.client.submit(staggered(), params=SLOW, completion_window=4)
        done = finish(chaos, "8b. expiry mid-job", job["id"], 1, datetime.now(UTC))
        assert done["status"] == "expired"
        assert done["counts"]["succeeded"] > 0 and done["counts"]["expired"] > 0
    finally:
        stack.stop_all()


def test_the_only_worker_of_one_model_dies(chaos: Chaos) -> None:
    # Two models, one worker each; every third item (a long one) names the second model. Its
    # worker dies mid-job: the first model's items finish regardless, the second's wait, shown
    # in the job's `waiting_for` once the worker is judged dead, and run when one starts again.
    base, other = DEMO_MODEL, "tiny-b"
    stack = fake_workers(chaos, "models")
    try:
        stack.start_worker("base", env={"THINKBATCH_SERVED_MODEL_NAME": base})
        worker = stack.start_worker("other", env={"THINKBATCH_SERVED_MODEL_NAME": other})
        batch = staggered()
        for k in range(1, N_ITEMS, 3):
            batch[k]["model"] = other
        job = chaos.client.submit(batch, params=SLOW)
        deadline = time.monotonic() + 60
        while True:  # it has stored results of its model and holds more when it dies
            share = share_by_worker(chaos, job["id"])
            mine = [v for w, v in share.items() if f":{worker.popen.pid}:" in w]
            if mine and mine[0][0] > 0 and mine[0][1] > 0:
                break
            assert time.monotonic() < deadline, share
            time.sleep(0.05)
        worker.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        worker.wait(10)

        def left(model: str) -> int:
            with chaos.db.connect() as conn:
                return conn.execute(
                    sa.text(
                        "SELECT count(*) FROM items i JOIN jobs j ON j.id = i.job_id"
                        " WHERE i.job_id = :id AND i.status IN ('pending', 'running')"
                        " AND coalesce(i.model, j.model) = :m"
                    ),
                    {"id": job["id"], "m": model},
                ).scalar_one()

        deadline = time.monotonic() + 60
        while left(base) or chaos.client.job(job["id"])["waiting_for"] != [other]:
            assert time.monotonic() < deadline, chaos.client.job(job["id"])
            time.sleep(0.2)
        waiting = chaos.client.job(job["id"])
        assert waiting["status"] == "running" and left(other) > 0
        assert waiting["counts"]["running"] == 0  # the dead worker's items were released
        waited_s = time.monotonic() - killed_at
        stack.start_worker("other-2", env={"THINKBATCH_SERVED_MODEL_NAME": other})
        fault_at = datetime.now(UTC)
        note = f"{left(other)} items of {other} waiting, shown {waited_s:.1f}s after the kill"
        done = finish(chaos, "9. the only worker of a model killed", job["id"], 1, fault_at, note)
        assert done["counts"]["succeeded"] == N_ITEMS and done["waiting_for"] == []
        with chaos.db.connect() as conn:
            wrong = conn.execute(
                sa.text(
                    "SELECT count(*) FROM item_results r JOIN items i ON i.id = r.item_id"
                    " JOIN jobs j ON j.id = i.job_id JOIN workers w ON w.id = r.worker_id"
                    " WHERE r.job_id = :id AND w.model <> coalesce(i.model, j.model)"
                ),
                {"id": job["id"]},
            ).scalar_one()
        assert wrong == 0
    finally:
        stack.stop_all()
