"""The API's own CPU per read, in-process (`python -m bench.poll_cpu`): the Flask app over
embedded PostgreSQL and Redis, called through Flask's test client, so that no HTTP server or
client enters the figures. A status call of a job underway (authentication, the failed-auth
limiter, the job read, the live workers while the job has pending items, serialization, access
log, logged as the API logs, and metrics), an items page of 100 finished items and the JSONL
results of a finished job of 100 items (what a poller downloads once its job is done), each with
the Postgres CPU it cost (the embedded cluster's, psutil); `make bench-scale` times the same
calls over HTTP. With `--stages`, one more round of each, after those, prints the call's CPU by
stage: each request hook and the view (bench/request_stages.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa
from flask.testing import FlaskClient

from api import create_app
from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.request_stages import RequestStages
from bench.request_stages import report
from bench.scale import fill_results
from bench.scale import settle
from devstack import local_stack
from thinkbatch import logging_setup
from thinkbatch.keys import issue_key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="status calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=1000, help="items of the polled job")
    parser.add_argument("--stages", action="store_true", help="and the CPU by request stage")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-poll-"))
    env = {"THINKBATCH_MODEL": "thinkbatch-demo"}
    with local_stack(tmp, env=env, database="poll", engine=False, demo_model=False) as local:
        settings = local.settings
        # Logged as the API logs (api/asgi.py): an access line per call, into nothing.
        sink = open(os.devnull, "w")  # noqa: SIM115 - open until the process ends
        logging_setup.configure(settings, "api", stream=sink)
        app = create_app(settings)
        key = issue_key(settings.require_database_url(), "bench", "bench.poll_cpu")
        client = app.test_client()
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        items = [{"custom_id": f"r{k}", "prompt": f"question {k}"} for k in range(args.items)]
        created = client.post("/v1/jobs", json={"items": items})
        assert created.status_code == 201 and created.json is not None, created.text
        status = f"/v1/jobs/{created.json['id']}"
        done = client.post("/v1/jobs", json={"items": items})
        assert done.status_code == 201 and done.json is not None, done.text
        fill_results(settings.require_database_url(), done.json["id"])
        underway(settings.require_database_url(), created.json["id"])
        page = f"/v1/jobs/{done.json['id']}/items?limit=100"
        small = client.post("/v1/jobs", json={"items": items[:100]})
        assert small.status_code == 201 and small.json is not None, small.text
        fill_results(settings.require_database_url(), small.json["id"])
        results = f"/v1/jobs/{small.json['id']}/results"
        figures = {}
        reads = (
            ("status", status, args.calls),
            ("page", page, args.calls // 4),
            ("results", results, args.calls // 4),
        )
        for name, path, calls in reads:
            for _ in range(100):  # warm: statement caches, the pool, the stats cache
                _read(client, path)
            rounds, postgres = [], []
            for _ in range(args.rounds):
                before = cpu_snapshot("poll")
                cpu = time.process_time()
                for _ in range(calls):
                    _read(client, path)
                rounds.append((time.process_time() - cpu) * 1000 / calls)
                postgres.append(cpu_used(before, "poll").get("postgres", 0.0) * 1000 / calls)
            figures[name] = (rounds, postgres, calls)
        # After the rounds above: the wrappers cost a little CPU of their own.
        split = {}
        if args.stages:
            stages = RequestStages(app)
            for name, path, calls in reads:
                stages.reset()
                cpu = time.thread_time()
                for _ in range(calls):
                    _read(client, path)
                split[name] = report(stages.cpu(), time.thread_time() - cpu, calls)
        services = app.extensions["thinkbatch"]  # closed before the servers stop
        services.engine.dispose()
        services.celery.close()
    for name, what in (
        ("status", f"status call of a {args.items}-item job underway"),
        ("page", "items page of 100 finished items"),
        ("results", "results of a finished 100-item job"),
    ):
        rounds, postgres, calls = figures[name]
        print(
            f"{what}, in-process: {statistics.median(rounds):.3f} ms of CPU per call (median of "
            f"{args.rounds} rounds of {calls}: {' '.join(f'{r:.3f}' for r in rounds)}); "
            f"Postgres {statistics.median(postgres):.3f} ms "
            f"({' '.join(f'{r:.3f}' for r in postgres)})"
        )
        if name in split:
            print(f"{name}, CPU per call by stage (one round of {calls}):")
            print("\n".join(split[name]))
    return 0


def _read(client: FlaskClient, path: str) -> None:
    response = client.get(path)
    response.get_data()  # a streamed body (the results) runs only as it is read
    assert response.status_code == 200, response.status_code


def underway(database_url: str, job_id: str) -> None:
    """The job as a worker leaves it partway: a tenth of its items stored, one in a hundred
    running, the rest pending; then the tables vacuumed and their statistics taken, so that
    autovacuum does not run during the rounds. A poll's statement is costed from those
    statistics (tests/unit/test_plan_reuse.py)."""
    engine = sa.create_engine(database_url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE items SET status = CASE WHEN seq % 100 = 0 THEN 'running' "
                    "WHEN seq % 10 = 1 THEN 'succeeded' ELSE status END WHERE job_id = :j"
                ),
                {"j": job_id},
            )
    finally:
        engine.dispose()
    settle(database_url)


if __name__ == "__main__":
    raise SystemExit(main())
