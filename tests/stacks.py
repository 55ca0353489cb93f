"""Real process stacks for the stack, end-to-end and chaos tests: gunicorn API, Celery workers
and Flower. `running_stack` is the one way a test module gets one: a database of its own
(created afresh and migrated), a Redis database of its own (handed out, never picked by hand),
the processes it asks for, and all of it stopped and closed afterwards."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
import sqlalchemy as sa

from devstack import demo_model
from devstack.demo_model import DEMO_MODEL
from devstack.demo_model import demo_model_env
from devstack.stack import CPU_ENGINE_DEFAULTS
from devstack.stack import Proc
from devstack.stack import Stack
from devstack.tiny_model import DEFAULT_DIR
from tests.helpers import TENANT
from tests.helpers import Servers
from tests.helpers import database_name
from tests.helpers import recreate_database
from thinkbatch.db import migrate
from thinkbatch.keys import issue_key

# The real engine on this CPU: the tiny demo Qwen3 (its checkpoint, served as thinkbatch-demo;
# build_demo_model() builds it) with the launcher's CPU defaults (eager mode, float32, small KV
# cache), and a shorter context and batch for quick tests.
VLLM_ENV = {
    "THINKBATCH_ENGINE": "vllm",
    **demo_model_env(Path(DEFAULT_DIR).resolve()),
    **CPU_ENGINE_DEFAULTS,
    "THINKBATCH_MAX_MODEL_LEN": "512",
    "THINKBATCH_MAX_NUM_SEQS": "32",
    "THINKBATCH_MAX_NUM_BATCHED_TOKENS": "2048",
}

# Short timeouts so recovery happens within a test (they still nest as production's do).
FAST_RECOVERY_ENV = {
    "THINKBATCH_ITEM_DEADLINE_S": "60",
    "THINKBATCH_LEASE_S": "90",
    "THINKBATCH_VISIBILITY_TIMEOUT_S": "300",
    "THINKBATCH_TASK_SLICE_S": "20",
    "THINKBATCH_HEARTBEAT_S": "1",
    "THINKBATCH_WORKER_DEAD_AFTER_S": "4",
    "THINKBATCH_SWEEP_INTERVAL_S": "1",
    "THINKBATCH_HINT_STALE_S": "3",
    "THINKBATCH_SHUTDOWN_TIMEOUT_S": "20",
    "THINKBATCH_WRITE_INTERVAL_S": "0.1",
}


def build_demo_model() -> None:
    demo_model.build_demo_model()


def redis_db(url: str, db: int) -> str:
    base = url.rsplit("/", 1)[0] if url.count("/") > 2 else url
    return f"{base}/{db}"


class _RedisDatabases:
    """Redis database numbers for stacks, one after the other (Redis has 0-15), never the
    tests' own database: a stack flushes what it is handed. Processes of one run that share a
    Redis server (pytest-xdist workers) each take their own share (`share`), so that no stack
    flushes another's broker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._numbers = itertools.cycle(range(16))

    def share(self, index: int, count: int, reserved: Sequence[int]) -> None:
        """Take only the numbers of process `index` of `count`, none of `reserved` (every
        process's own tests' database)."""
        mine = [n for n in range(16) if n % count == index and n not in reserved]
        with self._lock:
            self._numbers = itertools.cycle(mine)

    def take(self, tests_url: str) -> str:
        own = int(urlsplit(tests_url).path.strip("/") or 0)
        with self._lock:
            number = next(n for n in self._numbers if n != own)
        url = redis_db(tests_url, number)
        with redis.Redis.from_url(url) as client:
            client.flushdb()
        return url


REDIS_DATABASES = _RedisDatabases()


def api_key(database_url: str, tenant: str = TENANT) -> str:
    """A fresh API key of `tenant` in the stack's database (the stacks run with auth on)."""
    return issue_key(database_url, tenant, "tests")


# Flower's credentials in test stacks (random per run; tests read them from here).
FLOWER_AUTH = f"tests:{secrets.token_urlsafe(12)}"


class Client:
    def __init__(self, port: int | None, key: str, uds: Path | None = None):
        """A client of the API on 127.0.0.1:`port`, or on the Unix socket `uds`."""
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}" if uds is None else "http://api",
            transport=None if uds is None else httpx.HTTPTransport(uds=str(uds)),
            timeout=60,
            headers={"Authorization": f"Bearer {key}"},
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()  # its pooled sockets, left open, warned under whichever test came next

    def submit(self, items: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        response = self.http.post("/v1/jobs", json={"items": items, **fields})
        assert response.status_code == 201, response.text
        return response.json()

    def job(self, job_id: str) -> dict[str, Any]:
        return self.http.get(f"/v1/jobs/{job_id}").raise_for_status().json()

    def wait(self, job_id: str, timeout: float = 300, done: int | None = None) -> dict[str, Any]:
        """Until the job is finished (or, with `done`, until that many items are terminal)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            c = job["counts"]
            finished = c["succeeded"] + c["failed"] + c["cancelled"] + c["expired"]
            if done is not None and finished >= done:
                return job
            if job["status"] not in ("queued", "running", "cancelling"):
                return job
            time.sleep(0.2)
        raise AssertionError(f"job {job_id} not finished after {timeout}s: {self.job(job_id)}")

    def all_items(self, job_id: str, page: int = 100) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        after = None
        while True:
            params: dict[str, Any] = {"limit": page}
            if after:
                params["after"] = after
            body = self.http.get(f"/v1/jobs/{job_id}/items", params=params).json()
            items += body["data"]
            if not body["has_more"]:
                return items
            after = body["last_id"]

    def results(self, job_id: str) -> list[str]:
        return self.http.get(f"/v1/jobs/{job_id}/results").text.splitlines()


def make_stack(
    log_dir: Path, database_url: str, redis_url: str, netns: str | None = None, **env: str
) -> Stack:
    """A stack whose every process (API included: it names the model jobs ask for) serves the
    model `thinkbatch-demo`, unless `env` says otherwise (THINKBATCH_ names); the settings' own
    default is a production model. VLLM_ENV in `env` points a worker at the demo checkpoint."""
    return Stack(
        # No metrics port unless a test asks for one: several workers share this host.
        {
            "THINKBATCH_DATABASE_URL": database_url,
            "THINKBATCH_REDIS_URL": redis_url,
            "THINKBATCH_MODEL": DEMO_MODEL,
            "THINKBATCH_WORKER_METRICS_PORT": "0",
            **env,
        },
        log_dir,
        netns,
    )


def engine_for(url: str) -> sa.Engine:
    return sa.create_engine(url, pool_pre_ping=True)


@dataclass
class RunningStack:
    stack: Stack
    database_url: str
    broker: str
    db: sa.Engine
    api: Proc | None
    flower: Proc | None

    @property
    def base_url(self) -> str:
        assert self.api is not None and self.api.port is not None
        return f"http://127.0.0.1:{self.api.port}"

    def key(self, tenant: str = TENANT) -> str:
        return api_key(self.database_url, tenant)


@contextmanager
def running_stack(
    servers: Servers,
    log_dir: Path,
    name: str,
    *,
    api: bool = True,
    workers: Sequence[str] = ("worker",),
    flower: bool = False,
    worker_env: dict[str, str] | None = None,
    **env: str,
) -> Iterator[RunningStack]:
    """A stack on a database named after `name` and a Redis database of its own: the API
    (unless `api` is false), a worker per name in `workers` (waited for), and Flower behind
    FLOWER_AUTH if asked. `env` sets THINKBATCH_ variables of every process (make_stack)."""
    url = recreate_database(servers.postgres_admin_url, database_name(name))
    migrate(url)
    broker = REDIS_DATABASES.take(servers.redis_url)
    stack = make_stack(log_dir, url, broker, **env)
    db = engine_for(url)
    try:
        api_proc = stack.start_api() if api else None
        flower_proc = stack.start_flower(FLOWER_AUTH) if flower else None
        for worker in workers:
            stack.start_worker(worker, env=worker_env)
        yield RunningStack(stack, url, broker, db, api_proc, flower_proc)
    finally:
        stack.stop_all()
        db.dispose()
