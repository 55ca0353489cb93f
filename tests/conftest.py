"""Fixtures: a real PostgreSQL and a real Redis for every test.

TEST_DATABASE_URL / TEST_REDIS_URL point the tests at running servers (CI uses this machine's
services); without them the session starts its own servers from the embedded packages. Tests
get a database of their own (created fresh, migrated with Alembic) and a Redis database number
they may flush.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import hypothesis
import pytest
import redis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from tests import reports
from tests.helpers import TENANT
from tests.helpers import Servers
from tests.helpers import close_app
from tests.helpers import database_name
from tests.helpers import keyed_client
from tests.helpers import make_key
from tests.helpers import make_settings
from tests.helpers import recreate_database
from tests.stacks import REDIS_DATABASES
from thinkbatch.db import migrate
from thinkbatch.models import Base
from thinkbatch.settings import Settings

# `make check` and `make test` run their tiers in two processes (pytest-xdist, one per core
# here). Each worker process gets a database and a Redis database number of its own, and a share
# of the Redis numbers its stacks are handed, set here before any fixture or test reads them, so
# that tests written for one process need no change.
_XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _XDIST_WORKER:
    _n = int(_XDIST_WORKER.removeprefix("gw"))
    _count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _name = os.environ.get("TEST_DATABASE_NAME", "thinkbatch_test")
    os.environ["TEST_DATABASE_NAME"] = f"{_name}_{_XDIST_WORKER}"
    if _redis := os.environ.get("TEST_REDIS_URL"):
        _url = urlsplit(_redis)
        _base = int(_url.path.strip("/") or 0)
        _own = [(_base + 1 + k) % 16 for k in range(_count)]  # Redis has databases 0-15
        # A worker that replaces a crashed one (gw2 of two) takes the slot it fills.
        _slot = _n % _count
        os.environ["TEST_REDIS_URL"] = _url._replace(path=f"/{_own[_slot]}").geturl()
        REDIS_DATABASES.share(_slot, _count, [_base, *_own])


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its scenario lines go to the controller
        reports.collect(workeroutput)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist
def pytest_testnodedown(node: Any, error: object) -> None:
    reports.receive(getattr(node, "workeroutput", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports.write(terminalreporter.write_line)


# Emptied before each test, children first. DELETE, not TRUNCATE: a test leaves a few rows, and
# TRUNCATE's new files per table cost ~0.1 s a test on this host against ~0.01 s for DELETE.
TABLES = list(reversed(Base.metadata.sorted_tables))

# Fixtures kept in modules of their own, next to the helpers they use.
pytest_plugins = ["tests.runner_harness", "tests.streams"]

# The fuzzing (tests/api/test_openapi.py) takes hypothesis's default 100 examples per operation and
# mode; `make check`, the edit loop, passes --hypothesis-profile=check for a fifth of them.
hypothesis.settings.register_profile("check", max_examples=20)


# Threads a library keeps for the life of the process by design, never a test's leftovers: the
# runner's tokenizing pool is per runner and goes with it, these are not.
_PROCESS_THREADS: tuple[str, ...] = ()


@pytest.fixture(autouse=True)
def cpu_affinity_restored() -> Iterator[None]:
    """A runner on vLLM's CPU engine pins the process's threads (worker/affinity.py) as it
    would a worker's; in the test process that would outlast the test and skew the next."""
    before = os.sched_getaffinity(0)
    yield
    if os.sched_getaffinity(0) != before:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), before)
            except OSError:
                pass  # the thread ended meanwhile


@pytest.fixture(autouse=True)
def no_thread_outlives_its_test() -> Iterator[None]:
    """A thread a test started ends with it: a runner's housekeeper that beat on against a
    database the session had stopped, say, logged failures after the run's summary line."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5
    while True:
        left = [
            t
            for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.name.startswith(_PROCESS_THREADS)
        ]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == [], f"threads the test started still run: {[t.name for t in left]}"


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    pg_url = os.environ.get("TEST_DATABASE_URL")
    redis_url = os.environ.get("TEST_REDIS_URL")
    local_pg = local_redis = None
    if not pg_url:
        local_pg = LocalPostgres(tmp_path_factory.mktemp("pg") / "data", fast=True).start()
        pg_url = local_pg.url("postgres")
    if not redis_url:
        local_redis = LocalRedis(tmp_path_factory.mktemp("redis")).start()
        redis_url = local_redis.url(0)
    yield Servers(postgres_admin_url=pg_url, redis_url=redis_url)
    if local_redis:
        local_redis.stop()
    if local_pg:
        local_pg.stop()


@pytest.fixture(scope="session")
def database_url(servers: Servers) -> str:
    url = recreate_database(servers.postgres_admin_url, database_name())
    migrate(url)
    return url


@pytest.fixture(scope="session")
def redis_url(servers: Servers) -> str:
    with redis.Redis.from_url(servers.redis_url) as client:
        client.flushdb()
    return servers.redis_url


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    return make_settings(database_url, redis_url)


@pytest.fixture(scope="session")
def _db_engine(database_url: str) -> Iterator[sa.Engine]:
    # One pool for the session: a new engine per test paid a connection per test.
    engine = sa.create_engine(database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def db(settings: Settings, _db_engine: sa.Engine) -> sa.Engine:
    """The tests' database, emptied, and their Redis database, flushed."""
    with _db_engine.begin() as conn:
        for table in TABLES:
            conn.execute(table.delete())
    with redis.Redis.from_url(settings.require_redis_url()) as client:
        client.flushdb()
    return _db_engine


@pytest.fixture
def make_app(settings: Settings, db: sa.Engine) -> Iterator[Callable[..., Flask]]:
    """Apps on the tests' settings with `overrides`; each is closed after the test."""
    apps: list[Flask] = []

    def make(**overrides: object) -> Flask:
        apps.append(create_app(settings.model_copy(update=overrides)))
        return apps[-1]

    yield make
    for app in apps:
        close_app(app)


@pytest.fixture
def app(make_app: Callable[..., Flask]) -> Flask:
    return make_app()


@pytest.fixture
def client(app: Flask, db: sa.Engine) -> FlaskClient:
    """A client of the tests' tenant (the tests run with authentication on)."""
    return keyed_client(app, make_key(db, TENANT))


@pytest.fixture
def rival(app: Flask, db: sa.Engine) -> FlaskClient:
    """A client of another tenant, 'rival'."""
    return keyed_client(app, make_key(db, "rival"))


@pytest.fixture
def anonymous(app: Flask) -> FlaskClient:
    return app.test_client()
