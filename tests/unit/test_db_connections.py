"""Connections to PostgreSQL find out when the other end is gone, on both ends, within
WORKER_DEAD_AFTER_S (thinkbatch.db.DeadPeer). tests/hosts proves what that buys: a worker cut
off inside a transaction no longer stalls the fleet's stores and sweeps of that job."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from tests.helpers import make_settings
from thinkbatch.db import DeadPeer
from thinkbatch.db import make_engine


@pytest.mark.parametrize("silent", [2, 3, 4, 10, 30, 45.5, 600])
def test_a_dead_peer_is_found_within_the_time_a_silent_worker_is_given(silent: float) -> None:
    peer = DeadPeer.of(make_settings("postgresql://x/y", "redis://z", worker_dead_after_s=silent))
    assert peer.idle_s + peer.count * peer.interval_s <= max(silent, 4)  # 1 s probes at least
    assert peer.user_timeout_ms == max(1000, int(silent * 1000))
    assert peer.idle_s >= 1 and peer.interval_s >= 1 and peer.count >= 1


def test_the_defaults_give_up_after_25_to_30_seconds() -> None:
    peer = DeadPeer.of(make_settings("postgresql://x/y", "redis://z", worker_dead_after_s=30))
    assert (peer.idle_s, peer.interval_s, peer.count, peer.user_timeout_ms) == (10, 5, 3, 30000)


def test_both_ends_of_a_connection_carry_the_bounds(database_url: str, redis_url: str) -> None:
    settings = make_settings(database_url, redis_url, worker_dead_after_s=12)
    engine = make_engine(settings)
    try:
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            assert dbapi is not None
            # The settings were committed: the connection is handed out idle, in no transaction.
            assert dbapi.info.transaction_status == 0
            server = {
                name: conn.execute(sa.text(f"SHOW {name}")).scalar()
                for name in (
                    "tcp_keepalives_idle",
                    "tcp_keepalives_interval",
                    "tcp_keepalives_count",
                    "tcp_user_timeout",
                )
            }
            client = dbapi.info.get_parameters()
    finally:
        engine.dispose()
    if sa.make_url(database_url).host:  # over TCP; a Unix socket has no keepalives to set
        assert server == {
            "tcp_keepalives_idle": "4",
            "tcp_keepalives_interval": "2",
            "tcp_keepalives_count": "3",
            "tcp_user_timeout": "12000",
        }
    assert {k: client[k] for k in ("keepalives", "keepalives_idle", "tcp_user_timeout")} == {
        "keepalives": "1",
        "keepalives_idle": "4",
        "tcp_user_timeout": "12000",
    }
