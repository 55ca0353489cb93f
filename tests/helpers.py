"""Shared test helpers: settings, databases and keys of the tests, seeding jobs, and the
invariants every scenario must keep. Tests import from here, never from conftest.py (which
holds only fixtures): pytest imports conftest itself, and a second import of it by name can
make two copies of its objects."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from psycopg.pq import TransactionStatus
from sqlalchemy import event
from sqlalchemy import orm

from devstack.audit import lost_and_duplicated  # noqa: F401 - the tiers import it from here
from thinkbatch.jobs import JobService
from thinkbatch.keys import Caller
from thinkbatch.keys import create_key
from thinkbatch.models import Job
from thinkbatch.settings import Settings

ROOT = Path(__file__).resolve().parent.parent


IDLE = TransactionStatus.IDLE


def load_script(name: str) -> ModuleType:
    """scripts/<name>.py, executed afresh as module `name` (registered in sys.modules, where
    dataclasses look their module up). A script imports its siblings by bare name (lock.py:
    `from install import ...`) as when run from scripts/, so scripts/ is on the path meanwhile."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    scripts = str(ROOT / "scripts")
    sys.path.insert(0, scripts)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(scripts)
    return module


TENANT = "acme"  # the tenant of the `client` fixture and of tests.helpers.seed_job


@dataclass(frozen=True)
class Servers:
    postgres_admin_url: str  # a URL on the server's maintenance database
    redis_url: str


def _with_database(url: str, name: str) -> str:
    return sa.make_url(url).set(database=name).render_as_string(hide_password=False)


def database_name(suffix: str = "") -> str:
    """The tests' database: TEST_DATABASE_NAME, so that two checkouts can test side by side on
    one server; with a suffix, the database of one stack test (or scratch use), named after it,
    so that neither checkout drops the other's (DROP ... WITH (FORCE))."""
    base = os.environ.get("TEST_DATABASE_NAME", "thinkbatch_test")
    return f"{base}_{suffix}" if suffix else base


def recreate_database(admin_url: str, name: str) -> str:
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return _with_database(admin_url, name)


@contextmanager
def rollbacks_that_drop_prepared_statements(
    engine: sa.Engine, where: Callable[[], str | None]
) -> Iterator[list[str]]:
    """The rollbacks, while the block runs, of a transaction that had begun on one of the
    engine's connections: psycopg drops every prepared statement of a connection that rolls
    one back (thinkbatch.db.reads). Both kinds are caught: a Connection's own rollback, and the
    pool's when a connection is given back in a transaction. `where()` names the caller of
    each, or None for one not to count."""
    dropping: list[str] = []

    def rollback(conn: sa.Connection) -> None:
        dbapi = conn.connection.dbapi_connection
        label = where()
        if label is not None and dbapi is not None and dbapi.info.transaction_status != IDLE:
            dropping.append(f"{label}: {''.join(traceback.format_stack(limit=12))}")

    def reset(dbapi_connection: Any, *_: Any) -> None:
        label = where()
        if label is not None and dbapi_connection.info.transaction_status != IDLE:
            dropping.append(f"{label}: given back in a transaction")

    event.listen(engine, "rollback", rollback)
    event.listen(engine.pool, "reset", reset)
    try:
        yield dropping
    finally:
        event.remove(engine, "rollback", rollback)
        event.remove(engine.pool, "reset", reset)


def a_job_a_file_and_a_batch(
    call: Callable[..., Any], items: list[dict[str, str]]
) -> tuple[str, str, str]:
    """Through `call(method, path, **kwargs)` (answering the JSON): a job of `items`, a batch
    input file of three lines and a batch made of it."""
    job_id = call("POST", "/v1/jobs", json={"items": items})["id"]
    lines = b"\n".join(
        b'{"custom_id": "b%d", "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"model": "thinkbatch-demo", "messages": [{"role": "user", "content": "hi"}]}}'
        % k
        for k in range(3)
    )
    form = {"purpose": "batch", "file": (io.BytesIO(lines), "b.jsonl")}
    file_id = call("POST", "/v1/files", data=form)["id"]
    created = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    batch_id = call("POST", "/v1/batches", json={**created, "completion_window": "24h"})["id"]
    return job_id, file_id, batch_id


def get_routes(app: Flask, ids: dict[str, str]) -> list[tuple[str, str]]:
    """Every GET route of the app that reads the database, as (rule, URL) with its ids filled
    in from `ids` (job_id, file_id, batch_id); the static assets are left out."""
    routes = []
    for rule in app.url_map.iter_rules():
        if "GET" not in (rule.methods or ()) or {"filename", "name"} & set(rule.arguments):
            continue
        routes.append((rule.rule, rule.rule.replace("<", "{").replace(">", "}").format(**ids)))
    return routes


def make_settings(database_url: str, redis_url: str, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "database_url": database_url,
        "redis_url": redis_url,
        "engine": "fake",
        "model": "thinkbatch-demo",
        "max_num_seqs": 16,
        "max_model_len": 2048,
        "item_deadline_s": 20,
        "lease_s": 30,
        "visibility_timeout_s": 120,
        "task_slice_s": 30,
        "heartbeat_s": 0.5,
        "worker_dead_after_s": 3,
        "sweep_interval_s": 0.5,
        "hint_stale_s": 2,
        "write_interval_s": 0.05,
    }
    values.update(overrides)
    return Settings(_env_file=None, **values)  # type: ignore[arg-type]


def close_app(app: Flask) -> None:
    """Close what an app holds open: its database pool and its Celery broker pool."""
    services = app.extensions["thinkbatch"]
    services.engine.dispose()
    services.celery.close()


def make_key(engine: sa.Engine, tenant: str) -> str:
    with orm.Session(engine) as session, session.begin():
        key, _ = create_key(session, tenant, "tests")
    return key


def keyed_client(app: Flask, key: str) -> FlaskClient:
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    return client


def wait_until(
    condition: Callable[[], bool], timeout: float, what: str, poll: float = 0.02
) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds. Every wait
    in the tests has a deadline, so a regression fails the test instead of hanging the run."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(poll)


def submit_job(
    db: sa.Engine, settings: Settings, body: dict[str, Any], *, tenant: str = TENANT
) -> uuid.UUID:
    """Store a job from a request body through the path POST /v1/jobs takes (the streaming
    ingest, its validation and limits), without HTTP: what the runner then reads is what a
    client's submission would have stored."""
    raw = io.BytesIO(json.dumps(body).encode())
    service = JobService(settings, db, celery=None)
    return service.submit_stream(Caller(tenant, None), raw).job.id


def job_records(
    db: sa.Engine, settings: Settings, job_id: uuid.UUID, *, tenant: str = TENANT
) -> dict[str, dict[str, Any]]:
    """The job's item records by custom_id, as GET /v1/jobs/{id}/results streams them."""
    service = JobService(settings, db, celery=None)
    lines = b"".join(service.results(Caller(tenant, None), job_id)).splitlines()
    return {r["custom_id"]: r for r in map(json.loads, lines)}


def seed_job(
    db: sa.Engine, settings: Settings, n: int = 5, *, tenant: str = TENANT, **fields: Any
) -> uuid.UUID:
    items = [{"custom_id": f"i{k}", "prompt": f"prompt {k}"} for k in range(n)]
    return submit_job(db, settings, {"items": items, **fields}, tenant=tenant)


# A job's row with its pending and running counts, as the API shows them (models.Job).
# Its writers' deltas not yet folded into the row count too (ledger/counts.py).
_COUNTED = {"unfinished", "succeeded", "failed", "cancelled", "expired"} | {
    f"{kind}_tokens" for kind in ("prompt", "completion", "reasoning")
}
JOB_ROW = sa.text(
    f"""
    SELECT {", ".join(f"jobs.{c.name}" for c in Job.__table__.columns if c.name not in _COUNTED)},
           jobs.unfinished - d.ended AS unfinished, jobs.unfinished - d.ended - r.n AS pending,
           r.n AS running, jobs.succeeded + d.succeeded AS succeeded,
           jobs.failed + d.failed AS failed, jobs.cancelled + d.cancelled AS cancelled,
           jobs.expired + d.expired AS expired,
           jobs.prompt_tokens + d.prompt_tokens AS prompt_tokens,
           jobs.completion_tokens + d.completion_tokens AS completion_tokens,
           jobs.reasoning_tokens + d.reasoning_tokens AS reasoning_tokens
    FROM jobs, LATERAL (
        SELECT count(*) AS n FROM items WHERE items.job_id = jobs.id AND items.status = 'running'
    ) AS r, LATERAL (
        SELECT coalesce(sum(succeeded + failed + cancelled + expired), 0) AS ended,
               coalesce(sum(succeeded), 0) AS succeeded, coalesce(sum(failed), 0) AS failed,
               coalesce(sum(cancelled), 0) AS cancelled, coalesce(sum(expired), 0) AS expired,
               coalesce(sum(prompt_tokens), 0) AS prompt_tokens,
               coalesce(sum(completion_tokens), 0) AS completion_tokens,
               coalesce(sum(reasoning_tokens), 0) AS reasoning_tokens
        FROM job_count_deltas WHERE job_id = jobs.id
    ) AS d
    WHERE jobs.id = :id
    """  # noqa: S608 - the names are the model's columns
)


def check_invariants(db: sa.Engine, job_id: uuid.UUID, *, finished: bool = True) -> dict[str, int]:
    """Every item terminal (if finished), one result per succeeded item and none for others,
    job counters equal to a count over the items, usage equal to a sum over results, no item
    running without a live lease, every choice an item asked for in its one result."""
    with db.connect() as conn:
        job = conn.execute(JOB_ROW, {"id": job_id}).one()
        by_status = dict(
            conn.execute(
                sa.text("SELECT status, count(*) FROM items WHERE job_id = :id GROUP BY status"),
                {"id": job_id},
            ).all()
        )
        results = conn.execute(
            sa.text(
                "SELECT count(*) AS n, count(DISTINCT r.item_id) AS distinct_items,"
                " count(*) FILTER (WHERE i.status <> 'succeeded') AS orphans,"
                " coalesce(sum(r.prompt_tokens), 0) AS p,"
                " coalesce(sum(r.completion_tokens), 0) AS c,"
                " coalesce(sum(r.reasoning_tokens), 0) AS r"
                " FROM item_results r JOIN items i ON i.id = r.item_id WHERE r.job_id = :id"
            ),
            {"id": job_id},
        ).one()
        # Items that asked for several choices hold them all in their one result.
        short_of_choices = conn.execute(
            sa.text(
                "SELECT count(*) FROM item_results r JOIN items i ON i.id = r.item_id"
                " WHERE r.job_id = :id AND coalesce((i.params->>'n')::int, 1) > 1"
                " AND coalesce(jsonb_array_length(r.choices), 1) <> (i.params->>'n')::int"
            ),
            {"id": job_id},
        ).scalar()
        stale_running = conn.execute(
            sa.text(
                "SELECT count(*) FROM items i LEFT JOIN workers w ON w.id = i.lease_owner"
                " WHERE i.job_id = :id AND i.status = 'running'"
                " AND (i.lease_expires_at < now() OR w.stopped_at IS NOT NULL OR w.id IS NULL)"
            ),
            {"id": job_id},
        ).scalar()
    # The ledger keeps the finished statuses and `unfinished`; pending and running are split
    # from it by counting running items (JOB_ROW, as Job.running does).
    counts = {s: getattr(job, s) for s in ("succeeded", "failed", "cancelled", "expired")}
    assert counts == {s: by_status.get(s, 0) for s in counts}, (counts, by_status)
    assert job.unfinished == by_status.get("pending", 0) + by_status.get("running", 0), (
        job.unfinished,
        by_status,
    )
    counts |= {"pending": job.pending, "running": job.running}
    assert job.total == sum(by_status.values())
    assert results.n == results.distinct_items == by_status.get("succeeded", 0)
    assert results.orphans == 0
    assert (job.prompt_tokens, job.completion_tokens, job.reasoning_tokens) == (
        results.p,
        results.c,
        results.r,
    )
    assert stale_running == 0
    assert short_of_choices == 0
    if finished:
        assert counts["pending"] == counts["running"] == 0, counts
        assert job.status in ("completed", "failed", "cancelled", "expired"), job.status
    return counts


def burn_cpu(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU (a stage's work, for the tests that time stages)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
