"""Fixtures: a real PostgreSQL and a real Redis for every test.

TEST_DATABASE_URL / TEST_REDIS_URL point the tests at running servers (CI uses this machine's
services); without them the session starts its own servers from the embedded packages. Tests
get a database of their own (created fresh, migrated with Alembic) and a Redis database number
they may flush.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import redis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from api import create_app
from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from tests.helpers import TENANT
from tests.helpers import Servers
from tests.helpers import keyed_client
from tests.helpers import make_key
from tests.helpers import make_settings
from tests.helpers import recreate_database
from thinkbatch.db import migrate
from thinkbatch.settings import Settings

TABLES = "item_results, items, jobs, workers, api_keys"

# Fixtures kept in modules of their own, next to the helpers they use.
pytest_plugins = ["tests.runner_harness"]


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
