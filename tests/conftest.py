"""Fixtures: a real PostgreSQL and a real Redis for every test.

TEST_DATABASE_URL / TEST_REDIS_URL point the tests at running servers (CI uses this machine's
services); without them the session starts its own servers from the embedded packages. Tests
get a database of their own (created fresh, migrated with Alembic) and a Redis database number
they may flush.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import orm

from api import create_app
from thinkbatch.db import migrate
from thinkbatch.keys import create_key
from thinkbatch.local_services import LocalPostgres
from thinkbatch.local_services import LocalRedis
from thinkbatch.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
TENANT = "acme"  # the tenant of the `client` fixture and of tests.helpers.seed_job
TABLES = "item_results, items, jobs, workers, api_keys"


@dataclass(frozen=True)
class Servers:
    postgres_admin_url: str  # a URL on the server's maintenance database
    redis_url: str


def _with_database(url: str, name: str) -> str:
    return sa.make_url(url).set(database=name).render_as_string(hide_password=False)


def recreate_database(admin_url: str, name: str) -> str:
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return _with_database(admin_url, name)


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
    # TEST_DATABASE_NAME lets two checkouts run their tests side by side on one server.
    name = os.environ.get("TEST_DATABASE_NAME", "thinkbatch_test")
    url = recreate_database(servers.postgres_admin_url, name)
    migrate(url)
    return url


@pytest.fixture(scope="session")
def redis_url(servers: Servers) -> str:
    redis.Redis.from_url(servers.redis_url).flushdb()
    return servers.redis_url


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


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    return make_settings(database_url, redis_url)


@pytest.fixture
def db(settings: Settings) -> Iterator[sa.Engine]:
    engine = sa.create_engine(settings.require_database_url())
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {TABLES} CASCADE"))
    redis.Redis.from_url(settings.require_redis_url()).flushdb()
    yield engine
    engine.dispose()


@pytest.fixture
def app(settings: Settings, db: sa.Engine) -> Iterator[Flask]:
    app = create_app(settings)
    yield app
    app.extensions["thinkbatch"].engine.dispose()


def make_key(engine: sa.Engine, tenant: str) -> str:
    with orm.Session(engine) as session, session.begin():
        key, _ = create_key(session, tenant, "tests")
    return key


def keyed_client(app: Flask, key: str) -> FlaskClient:
    client = app.test_client()
    client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
    return client


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
