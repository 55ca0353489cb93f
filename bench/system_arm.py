"""The job system's arm of `make bench`: one API and one worker on the local stack, a round as a
client runs a job (submit, poll, read its timeline back from Postgres), and the rate at which
the worker's result statement alone stores rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.cpu import worker_cpu
from bench.workload import prompts
from devstack.services import free_port
from devstack.stack import Stack
from devstack.stack import readiness_wait
from thinkbatch.keys import issue_key
from thinkbatch.settings import Settings
from thinkbatch.settings import get_settings


def start_system(
    stack: Stack, settings: Settings, profile: Path | None
) -> tuple[httpx.Client, Any, int]:
    """The job system arm: one API and one worker (and py-spy on the worker if asked). Returns
    the client, py-spy's process and the worker's metrics port (its CPU by stage)."""
    api = stack.start_api(workers=2)
    metrics_port = free_port()
    worker = stack.start_worker(
        "worker", env={"THINKBATCH_WORKER_METRICS_PORT": str(metrics_port)}, wait=False
    )
    stack.wait_worker_ready(worker, **readiness_wait(settings))
    spy = None
    if profile is not None:  # sample the worker's Python stacks while the jobs run
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(worker.pid),
             "--rate", "50", "--gil", "--nonblocking", "--format", "raw", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1)
    key = issue_key(
        stack.env.get("THINKBATCH_DATABASE_URL") or get_settings().require_database_url(),
        "bench",
        "make bench",
    )
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{api.port}",
        timeout=300,
        headers={"Authorization": f"Bearer {key}"},
    )
    return client, spy, metrics_port


def system_round(
    client: httpx.Client,
    db: sa.Engine,
    n: int,
    max_tokens: int,
    round_no: int,
    metrics_port: int | None = None,
) -> dict[str, Any]:
    """One job of `n` items, as a client runs it. With the worker's `metrics_port`, the worker's
    CPU by stage and thread (worker/stages.py) over the round too."""
    body = {
        "items": prompts(n, round_no),
        "params": {"ignore_eos": True, "max_tokens": max_tokens, "temperature": 0},
    }
    result = job_round(client, db, body, metrics_port)
    if result["succeeded"] != n:
        raise RuntimeError(f"the benchmark job did not complete: {result['job']}")
    return result


def job_round(
    client: httpx.Client,
    db: sa.Engine,
    body: dict[str, Any],
    metrics_port: int | None = None,
) -> dict[str, Any]:
    """One job of any body, submit to `completed`; its items may fail (`succeeded` counts those
    that did not), the job itself must complete."""
    n = len(body["items"])
    database = db.url.database or ""
    cpu_before = cpu_snapshot(database)
    stages_before = worker_cpu(metrics_port) if metrics_port else {}
    submitted = datetime.now(UTC)
    started = time.perf_counter()
    job = client.post("/v1/jobs", json=body).raise_for_status().json()
    submit_s = time.perf_counter() - started
    # Postgres's share up to the submit's answer (the COPY, the quota, the job row), apart from
    # what the run costs it after (claims, stores, the ANALYZE of a large submit, sweeps).
    cpu_submit = cpu_used(cpu_before, database)
    while job["status"] in ("queued", "running"):
        # As a client polls: once a second. The job's own finished_at ends the measurement, so
        # the interval only sets how much CPU the polling takes from the engine: a GET of a
        # 2,000-item job takes 4-6 ms of API and Postgres time, ~25 of them a round at 0.2 s.
        time.sleep(1.0)
        job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
    cpu = cpu_used(cpu_before, database)
    stages_after = worker_cpu(metrics_port) if metrics_port else {}
    if job["status"] != "completed":
        raise RuntimeError(f"the benchmark job did not complete: {job}")
    with db.connect() as conn:
        first, last = conn.execute(
            sa.text("SELECT min(created_at), max(created_at) FROM item_results WHERE job_id = :j"),
            {"j": job["id"]},
        ).one()
        first_claim = conn.execute(
            sa.text("SELECT min(started_at) FROM items WHERE job_id = :j"), {"j": job["id"]}
        ).scalar_one()
    finished = datetime.fromisoformat(job["finished_at"])
    first, last = first or finished, last or finished  # no result stored: every item failed
    stages = {k: v - stages_before.get(k, 0.0) for k, v in stages_after.items()}
    return {
        "seconds": (finished - submitted).total_seconds(),
        "steps": stages.pop("engine steps", 0.0),
        "step_requests": stages.pop("engine step requests", 0.0),
        "prefix_queries": stages.pop("prefix cache queries", 0.0),
        "prefix_hits": stages.pop("prefix cache hits", 0.0),
        "submit_seconds": submit_s,
        "first_claim_seconds": (first_claim - submitted).total_seconds(),
        "first_result_seconds": (first - submitted).total_seconds(),
        "last_result_seconds": (last - submitted).total_seconds(),
        "rows_per_second": n / max((last - first).total_seconds(), 1e-9),
        "output_tokens": job["usage"]["completion_tokens"],
        "cpu": cpu,
        "cpu_submit": cpu_submit,
        "stages": stages,
        "succeeded": job["counts"]["succeeded"],
        "job": job,
    }


def write_capacity(database_url: str, n: int = 6000, batch: int = 500) -> float:
    """Rows/s the worker's result statement (ledger.complete) stores, apart from the engine."""
    from sqlalchemy import orm

    from thinkbatch import ledger
    from thinkbatch.jobs import ItemIn
    from thinkbatch.jobs import JobHeader
    from thinkbatch.jobs import JobService
    from thinkbatch.keys import LOCAL

    settings = Settings(database_url=database_url)
    engine = sa.create_engine(database_url)
    items = (ItemIn(prompt=f"p{k}") for k in range(n))
    owner = f"bench-{os.getpid()}-{time.time_ns()}"  # runs against the same database add up
    job_id = JobService(settings, engine, celery=None).submit(LOCAL, items, JobHeader()).job.id
    with orm.Session(engine) as session, session.begin():
        session.execute(
            sa.text("INSERT INTO workers (id, hostname, pid, model) VALUES (:id, 'h', 0, 'm')"),
            {"id": owner},
        )
    with engine.begin() as conn:
        claimed = ledger.claim(conn, job_id, owner=owner, n=n, lease_s=600)
    text = "Continuous batching keeps the engine busy. " * 6
    done = [ledger.Done(c.id, job_id, c.attempt, text, text, "length", False, 20, 64, 30)
            for c in claimed]  # fmt: skip
    started = time.perf_counter()
    for k in range(0, n, batch):
        with engine.begin() as conn:
            ledger.complete(conn, owner, done[k : k + batch])
    elapsed = time.perf_counter() - started
    with engine.begin() as conn:
        ledger.finalize_jobs(conn, [job_id])
        ledger.mark_stopped(conn, owner)
    engine.dispose()
    return n / elapsed


def top_frames(folded: Path, limit: int = 12) -> list[tuple[float, str]]:
    """Share of the worker's samples by innermost frame, from py-spy's raw output."""
    counts: dict[str, int] = {}
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(n)
        total += int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [(100 * c / max(total, 1), frame) for frame, c in ranked]
