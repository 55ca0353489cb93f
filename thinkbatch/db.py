"""Database engine and sessions, built from Settings. Shared by the API, the worker and tools."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc
from sqlalchemy import orm

from thinkbatch.settings import Settings

T = TypeVar("T")


@dataclass(frozen=True)
class DeadPeer:
    """How a connection finds out that the other end is gone: TCP keepalive probes on an idle
    connection, and a bound on how long sent data may go unacknowledged (TCP_USER_TIMEOUT).

    Without them a connection to a host behind a broken link waits as long as the kernel's
    retransmissions do (some 15 minutes by default) and, worse, the server keeps the session of
    a client that vanished mid-transaction for the two hours of the system's keepalive default,
    holding its locks: one worker cut off inside a store stalls every other worker's stores of
    that job, and the sweeper's release of its items. Both ends get the same bounds, derived
    from WORKER_DEAD_AFTER_S, the time after which the fleet gives up on a silent worker: by
    then the database has given up on its sessions too."""

    idle_s: int
    interval_s: int
    count: int
    user_timeout_ms: int

    @classmethod
    def of(cls, settings: Settings) -> DeadPeer:
        silent = settings.worker_dead_after_s
        # idle + count x interval, and the unacknowledged-data bound, stay within `silent`.
        return cls(
            idle_s=max(1, int(silent / 3)),
            interval_s=max(1, int(silent / 6)),
            count=3,
            user_timeout_ms=max(1000, int(silent * 1000)),
        )

    def connect_args(self) -> dict[str, object]:
        """libpq's parameters for this end of the connection."""
        return {
            "keepalives": 1,
            "keepalives_idle": self.idle_s,
            "keepalives_interval": self.interval_s,
            "keepalives_count": self.count,
            "tcp_user_timeout": self.user_timeout_ms,
        }

    def server_settings(self) -> str:
        """The same for the server's end of the session (SET, ignored on a Unix socket)."""
        return (
            f"SET tcp_keepalives_idle = {self.idle_s}; "
            f"SET tcp_keepalives_interval = {self.interval_s}; "
            f"SET tcp_keepalives_count = {self.count}; "
            f"SET tcp_user_timeout = {self.user_timeout_ms}"
        )


def make_engine(settings: Settings, **kwargs: object) -> sa.Engine:
    url = sa.make_url(settings.require_database_url())
    if url.drivername in ("postgresql", "postgres"):
        # psycopg 3 is the driver we ship; a bare postgresql:// URL would ask for psycopg2.
        url = url.set(drivername="postgresql+psycopg")
    peer = DeadPeer.of(settings)
    options: dict[str, object] = {
        # A restarted Postgres leaves dead connections in the pool; ping before use.
        "pool_pre_ping": True,
        "pool_size": settings.db_pool_size,
        "max_overflow": settings.db_pool_size,
        "connect_args": {"connect_timeout": 5, **peer.connect_args()},
    }
    options.update(kwargs)
    engine = sa.create_engine(url, **options)
    # Set on each new connection, not passed as a startup `options` parameter: connection
    # poolers (PgBouncer) refuse unknown startup parameters unless told to ignore them.
    statement = peer.server_settings()

    @event.listens_for(engine, "connect")
    def _bound_dead_peers(dbapi_connection: Any, _record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(statement)
        dbapi_connection.commit()

    return engine


def migrate(url: str, revision: str = "head", *, down: bool = False) -> None:
    """Run the repository's Alembic migrations on `url` (upgrade, or downgrade with down)."""
    from alembic import command
    from alembic.config import Config

    root = Path(__file__).resolve().parent.parent
    config = Config(toml_file=str(root / "pyproject.toml"))
    engine = sa.create_engine(url)
    # Each migration commits on its own (migrations/env.py): one that builds an index
    # CONCURRENTLY must run outside any transaction.
    with engine.connect() as conn:
        config.attributes["connection"] = conn
        (command.downgrade if down else command.upgrade)(config, revision)
    engine.dispose()


def make_sessionmaker(engine: sa.Engine) -> orm.sessionmaker[orm.Session]:
    return orm.sessionmaker(engine, expire_on_commit=False)


def is_transient(error: BaseException) -> bool:
    """Errors worth retrying: a lost connection, a restart, a deadlock, a serialization failure."""
    if isinstance(error, exc.DBAPIError):
        if error.connection_invalidated:
            return True
        sqlstate = getattr(error.orig, "sqlstate", None) or ""
        # 08: connection exception; 57P: operator intervention (shutdown); 40001/40P01:
        # serialization failure / deadlock; 53300: too many connections.
        return (
            sqlstate.startswith("08")
            or sqlstate.startswith("57P")
            or sqlstate in ("40001", "40P01", "53300")
            or isinstance(error, exc.OperationalError | exc.InterfaceError)
        )
    return False


def retry_transient(
    fn: Callable[[], T],
    *,
    attempts: int | None = None,
    base_delay: float = 0.2,
    max_delay: float = 5.0,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Run `fn`, retrying transient database errors with capped exponential backoff.

    `attempts=None` retries until `should_stop()` says so: the worker must not drop results
    because Postgres restarted.
    """
    delay = base_delay
    tried = 0
    while True:
        try:
            return fn()
        except exc.DBAPIError as error:
            tried += 1
            if not is_transient(error):
                raise
            if attempts is not None and tried >= attempts:
                raise
            if should_stop is not None and should_stop():
                raise
            time.sleep(delay)
            delay = min(max_delay, delay * 2)
