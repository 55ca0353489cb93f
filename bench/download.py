"""What a small job's download costs Postgres (`python -m bench.download`): the JSONL results of
a finished 100-item job, read as the API reads them (thinkbatch/jobs/results.py `of_job`:
the head by its prepared statement, the rest streamed), against the same rows streamed by one
statement, as every download was read before (planned by Postgres on each call), in
interleaved rounds on one pooled connection. Postgres's CPU is its backend's (psutil, the
embedded cluster); the client's is this process's. Most downloads are small: a poller fetching
its job's results once it is done.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

from api import create_app
from bench.scale import fill_results
from devstack import local_stack
from thinkbatch.db import Prepared
from thinkbatch.jobs import results
from thinkbatch.keys import issue_key

# Compiled once, as the API compiled it.
_WHOLE = Prepared(results.query(sa.bindparam("job_id", type_=sa.Uuid)))


def one_statement(engine: sa.Engine, job_id: uuid.UUID) -> int:
    """The baseline: the whole download as one statement, streamed, after its bounds' round
    trip, ended by a commit."""
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor:
            cursor.execute(
                "SELECT set_config('tcp_user_timeout', '0', true), "
                "set_config('statement_timeout', '0', true)"
            )
            values = {**_WHOLE.defaults, "job_id": job_id}
            rows = sum(1 for _ in cursor.stream(_WHOLE.sql, values, size=1000))
        driver.commit()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100, help="items of the downloaded job")
    parser.add_argument("--calls", type=int, default=2000, help="downloads per round and arm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-download-"))
    env = {"THINKBATCH_MODEL": "thinkbatch-demo"}
    with local_stack(tmp, env=env, database="download", engine=False, demo_model=False) as local:
        settings = local.settings
        url = settings.require_database_url()
        app = create_app(settings)
        flask_client = app.test_client()
        key = issue_key(url, "bench", "bench.download")
        flask_client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        items = [{"custom_id": f"r{k}", "prompt": f"q {k}"} for k in range(args.items)]
        created = flask_client.post("/v1/jobs", json={"items": items})
        assert created.status_code == 201 and created.json is not None, created.text
        job_id = uuid.UUID(created.json["id"])
        fill_results(url, str(job_id))
        services = app.extensions["thinkbatch"]
        services.engine.dispose()
        services.celery.close()
        engine = sa.create_engine(url, pool_size=1, max_overflow=0)
        with engine.connect() as conn:
            backend = psutil.Process(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())
        arms: dict[str, Callable[[], Any]] = {
            "one statement": lambda: one_statement(engine, job_id),
            "head prepared": lambda: sum(1 for _ in results.of_job(engine, job_id)),
        }
        for read in arms.values():  # warm both, and check they read the same rows
            assert read() == args.items
        figures: dict[str, tuple[list[float], list[float]]] = {a: ([], []) for a in arms}
        for round_ in range(args.rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for arm in order:
                server_at = sum(backend.cpu_times()[:2])
                client_at = time.process_time()
                for _ in range(args.calls):
                    arms[arm]()
                server_us = (sum(backend.cpu_times()[:2]) - server_at) * 1e6 / args.calls
                figures[arm][0].append(server_us)
                figures[arm][1].append((time.process_time() - client_at) * 1e6 / args.calls)
        engine.dispose()
    print(
        f"benchmark: the results of a finished {args.items}-item job, {args.calls} downloads "
        f"per round and arm, {args.rounds} rounds, arms interleaved (order turning); CPU per "
        f"download, us"
    )
    base = statistics.median(figures["one statement"][0])
    for arm, (server, client) in figures.items():
        print(
            f"{arm:14s} postgres {statistics.median(server):6.0f} "
            f"({' '.join(f'{us:.0f}' for us in server)}); client {statistics.median(client):6.0f}"
        )
    ratio = statistics.median(figures["head prepared"][0]) / base
    print(f"postgres, head prepared / one statement: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
