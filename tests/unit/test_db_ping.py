"""A pooled connection is tested before use with a round trip only where there is a reason to
(thinkbatch.db.needs_ping): one just given back goes out as it is, unless the server has
ended its session since; one idle for longer than DB_PING_AFTER_IDLE_S is pinged. Either way
a dead connection is replaced and the caller never sees it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.helpers import make_settings
from thinkbatch import db as dbmod
from thinkbatch.db import make_engine


@pytest.fixture
def pings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    made: list[int] = []
    real = dbmod.ping

    def counted(dbapi_connection: Any) -> None:
        made.append(1)
        real(dbapi_connection)

    monkeypatch.setattr(dbmod, "ping", counted)
    return made


def _engine(database_url: str, redis_url: str, idle_s: float) -> Iterator[sa.Engine]:
    settings = make_settings(database_url, redis_url, db_ping_after_idle_s=idle_s)
    engine = make_engine(settings, pool_size=1, max_overflow=0)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def engine(database_url: str, redis_url: str) -> Iterator[sa.Engine]:
    yield from _engine(database_url, redis_url, idle_s=60)


def _backend(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())


def test_a_connection_used_a_moment_ago_goes_out_without_a_round_trip(
    engine: sa.Engine, pings: list[int]
) -> None:
    first = _backend(engine)
    assert [_backend(engine) for _ in range(20)] == [first] * 20
    assert pings == []


def test_a_session_the_server_ended_is_replaced_before_use(
    engine: sa.Engine, pings: list[int], db: sa.Engine
) -> None:
    first = _backend(engine)
    with db.connect() as other:
        other.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
    time.sleep(0.2)  # the server's goodbye reaches the socket
    second = _backend(engine)  # no error: found dead at checkout and replaced
    assert second != first
    assert len(pings) == 1


def test_a_connection_idle_past_the_bound_is_pinged(
    database_url: str, redis_url: str, pings: list[int]
) -> None:
    for engine in _engine(database_url, redis_url, idle_s=0.05):
        first = _backend(engine)
        time.sleep(0.1)
        assert _backend(engine) == first
        assert len(pings) == 1


def test_zero_pings_before_every_use(database_url: str, redis_url: str, pings: list[int]) -> None:
    for engine in _engine(database_url, redis_url, idle_s=0):
        for _ in range(5):
            _backend(engine)
        assert len(pings) == 5


def test_a_ping_leaves_the_connection_idle_in_no_transaction(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        dbapi = conn.connection.dbapi_connection
        assert dbapi is not None
        dbmod.ping(dbapi)
        assert dbapi.info.transaction_status == 0
