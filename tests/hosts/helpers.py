"""The multi-host tier's shared types: the lab (network, servers, API), the workers on its
hosts, what a worker says about its fenced writes, and the report lines printed at the end of
the run (conftest.py). Scenarios import these from here, never from conftest.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from devstack.services import in_netns
from devstack.stack import Proc
from devstack.stack import Stack
from tests.helpers import check_invariants
from tests.helpers import lost_and_duplicated
from tests.hosts.netns import DB_ADDR
from tests.hosts.netns import REDIS_ADDR
from tests.hosts.netns import Host
from tests.hosts.netns import Network
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import VLLM_ENV
from tests.stacks import Client
from tests.stacks import make_stack

METRICS_PORT = 9101  # every worker has a namespace, and so a loopback, of its own
FAKE_ENV = {
    "THINKBATCH_ENGINE": "fake",
    "THINKBATCH_MAX_NUM_SEQS": "16",
    # One token per 10 ms: an item of 100 tokens takes a second, so a worker holds leases
    # on items that are still computing whenever a fault lands.
    "THINKBATCH_ENGINE_EXTRA_ARGS": '{"step_s": 0.01}',
    # A window of a fixed 2 x MAX_NUM_SEQS items: what a worker holds stays small and known.
    "THINKBATCH_INFLIGHT_LOOKAHEAD_S": "0",
    "THINKBATCH_WORKER_METRICS_PORT": str(METRICS_PORT),
    "THINKBATCH_LOG_LEVEL": "INFO",
}


@dataclass
class HostReport:
    name: str
    items: int
    faults: int
    lost: int
    duplicated: int
    fenced: int  # late writes of the faulty host that the fence refused (its own count)
    recover_s: float  # from the fault to the next item finished
    finish_s: float  # from the fault to the job's end
    note: str = ""


REPORTS: list[HostReport] = []


@dataclass
class Lab:
    network: Network
    pg: LocalPostgres
    redis: LocalRedis
    database_url: str  # the tests' own way in: PostgreSQL's Unix socket
    db: sa.Engine
    client: Client
    log_dir: Path

    def worker_stack(self, host: Host, scenario: str, **env: str) -> Stack:
        """A stack for a scenario's worker on `host`, reaching PostgreSQL and Redis over the
        host's link (stopped by the scenario)."""
        return make_stack(
            self.log_dir / scenario / host.name,
            self.pg.url("hosts", host=DB_ADDR),
            self.redis.url(0, host=REDIS_ADDR),
            host.netns,
            **{**FAST_RECOVERY_ENV, **FAKE_ENV, **env},
        )


@dataclass
class Worker:
    host: Host
    stack: Stack
    proc: Proc

    @property
    def owner_like(self) -> str:
        """A LIKE pattern of the worker's lease owner (hostname:pid:random)."""
        return f"%:{self.proc.pid}:%"

    def metric(self, name: str) -> float:
        """The sum of a metric's samples on the worker's /metrics, read inside its namespace."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith(name) and not line.startswith("#"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def metrics_text(self) -> str:
        done = subprocess.run(
            [
                "ip", "netns", "exec", self.host.netns, sys.executable, "-c",
                "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen("
                f"'http://127.0.0.1:{METRICS_PORT}/metrics', timeout=10).read().decode())",
            ],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return done.stdout

    def fenced_in_log(self) -> int:
        """The writes the worker logged as refused by the fence, summed over its log lines."""
        return sum(line.get("fenced", 0) for line in self.log_lines("refused by the fence"))

    def fenced(self, quiet_s: float = 2.0, timeout: float = 60) -> int:
        """The writes the fence refused, once the worker's log and its /metrics agree on them
        and no more came for `quiet_s` (its backlog may take several batches)."""
        seen, since = -1, time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            logged = self.fenced_in_log()
            counted = self.metric("thinkbatch_worker_fenced_writes_total")
            if logged != counted or logged != seen:
                seen, since = logged, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return logged
            time.sleep(0.2)
        raise AssertionError(f"log ({logged}) and /metrics ({counted}) disagree on fenced writes")

    def log_lines(self, containing: str) -> list[dict[str, Any]]:
        lines = []
        for raw in self.proc.log_text().splitlines():
            if containing in raw and raw.startswith("{"):
                lines.append(json.loads(raw))
        return lines


class Fleet:
    """The workers of one scenario, one per host; all stopped at its end."""

    def __init__(self, lab: Lab, scenario: str):
        self.lab, self.scenario = lab, scenario
        self.workers: dict[str, Worker] = {}

    def start(self, *names: str, env: dict[str, dict[str, str]] | None = None) -> list[Worker]:
        """Start a worker on each named host at once (with `env[name]` added to its settings);
        return when all are ready."""
        started = []
        for name in names:
            host = self.lab.network.host(name)
            stack = self.lab.worker_stack(host, self.scenario, **(env or {}).get(name, {}))
            started.append(Worker(host, stack, stack.start_worker(name, wait=False)))
        for worker in started:
            worker.stack.wait_worker_ready(worker.proc)
            self.workers[worker.host.name] = worker
        return started

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.show_logs()  # pytest shows a failed test's output: what each worker said
        for worker in self.workers.values():
            worker.stack.stop_all()

    def show_logs(self, lines: int = 40) -> None:
        for name, worker in self.workers.items():
            said = [
                line[:400]
                for line in worker.proc.log_text().splitlines()
                if '"level": "INFO"' not in line
            ]
            print(f"--- {name} ({worker.proc.log}), last {lines} lines above INFO:")
            print("\n".join(said[-lines:]))


def items(n: int, prefix: str = "q") -> list[dict[str, Any]]:
    return [
        {"custom_id": f"{prefix}{k}", "messages": [{"role": "user", "content": f"Question {k}?"}]}
        for k in range(n)
    ]


# The real engine (vLLM on the CPU, the demo model) for one host of a fleet of fake ones: all
# serve the model `thinkbatch-demo`, so a job's items go to whichever claims them.
VLLM_HOST_ENV = {**VLLM_ENV, "THINKBATCH_ENGINE_EXTRA_ARGS": "{}"}

# Every item computes for exactly this many engine steps (a second at FAKE_ENV's step).
PARAMS = {"ignore_eos": True, "max_tokens": 100, "temperature": 0}


def share(db: sa.Engine, job_id: str, worker: Worker) -> tuple[int, int]:
    """(items the worker holds now, results it stored) in one job."""
    with db.connect() as conn:
        row = conn.execute(
            sa.text(
                "SELECT (SELECT count(*) FROM items WHERE job_id = :id AND status = 'running'"
                "        AND lease_owner LIKE :w),"
                " (SELECT count(*) FROM item_results WHERE job_id = :id AND worker_id LIKE :w)"
            ),
            {"id": job_id, "w": worker.owner_like},
        ).one()
    return int(row[0]), int(row[1])


def wait_for(condition: Any, timeout: float, what: str, poll: float = 0.1) -> Any:
    """Poll until `condition()` is truthy and return its value; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(poll)


def finish(
    lab: Lab,
    name: str,
    job_id: str,
    *,
    faults: int,
    fault_at: datetime,
    fenced: int = 0,
    note: str = "",
) -> dict[str, Any]:
    """Wait for the job, check the invariants every scenario keeps, and record the report
    line. Times are measured from `fault_at`: when the fault began, since the fleet must carry
    the job through it (a cut host stays cut until the job is done), or, for a job that comes
    after the fault, when the fault ended."""
    job = lab.client.wait(job_id, timeout=300)
    done_at = datetime.now(UTC)
    counts = check_invariants(lab.db, uuid.UUID(job_id))
    lost, duplicated = lost_and_duplicated(lab.db, job_id)
    with lab.db.connect() as conn:
        first = conn.execute(
            sa.text("SELECT min(finished_at) FROM items WHERE job_id = :id AND finished_at > :t"),
            {"id": job_id, "t": fault_at},
        ).scalar()
    recover = max(0.0, ((first or done_at) - fault_at).total_seconds())
    REPORTS.append(
        HostReport(
            name, job["counts"]["total"], faults, lost, duplicated, fenced, recover,
            max(0.0, (done_at - fault_at).total_seconds()), note,
        )
    )  # fmt: skip
    assert lost == 0 and duplicated == 0
    assert job["status"] == "completed", job
    assert counts["succeeded"] == job["counts"]["total"], counts
    job["checked_counts"] = counts
    return job


def stored_by(db: sa.Engine, job_id: str, worker: Worker, after: datetime | None = None) -> int:
    """Results of a job that the worker stored (after a moment, if given)."""
    query = "SELECT count(*) FROM item_results WHERE job_id = :id AND worker_id LIKE :w"
    params: dict[str, Any] = {"id": job_id, "w": worker.owner_like}
    if after is not None:
        query += " AND created_at > :t"
        params["t"] = after
    with db.connect() as conn:
        return int(conn.execute(sa.text(query), params).scalar_one())


def worker_row(db: sa.Engine, worker: Worker) -> Any:
    with db.connect() as conn:
        return conn.execute(
            sa.text("SELECT id, heartbeat_at, stopped_at FROM workers WHERE id LIKE :w"),
            {"w": worker.owner_like},
        ).one()


# A transaction of the worker's, caught open by a fault: on the worker's own connection settings
# (thinkbatch.db.make_engine, its environment), it takes the lock on a job's row that a store
# takes, and holds it. A fault landing inside one of the writer's transactions is a matter of
# milliseconds; this makes it certain.
_HOLD_LOCK = """
import sys, time, uuid
from thinkbatch import ledger
from thinkbatch.db import make_engine
from thinkbatch.settings import Settings
with make_engine(Settings()).begin() as conn:
    ledger.lock_jobs(conn, [uuid.UUID(sys.argv[1])])
    print("locked", flush=True)
    time.sleep(600)
"""


@contextlib.contextmanager
def open_transaction(worker: Worker, job_id: str) -> Iterator[None]:
    """A transaction from the worker's host that holds the job's lock, while the block runs."""
    probe = subprocess.Popen(
        in_netns(worker.host.netns, [sys.executable, "-c", _HOLD_LOCK, job_id]),
        env=worker.stack.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert probe.stdout is not None
        line = probe.stdout.readline()
        assert line.strip() == "locked", line + probe.stdout.read()
        yield
    finally:
        probe.kill()
        probe.wait()
        if probe.stdout is not None:
            probe.stdout.close()
