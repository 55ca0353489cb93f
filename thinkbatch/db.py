"""Database engine and sessions, built from Settings. Shared by the API, the worker and tools."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy import orm

from thinkbatch.settings import Settings

T = TypeVar("T")


def make_engine(settings: Settings, **kwargs: object) -> sa.Engine:
    url = sa.make_url(settings.require_database_url())
    if url.drivername in ("postgresql", "postgres"):
        # psycopg 3 is the driver we ship; a bare postgresql:// URL would ask for psycopg2.
        url = url.set(drivername="postgresql+psycopg")
    options: dict[str, object] = {
        # A restarted Postgres leaves dead connections in the pool; ping before use.
        "pool_pre_ping": True,
        "pool_size": settings.db_pool_size,
        "max_overflow": settings.db_pool_size,
        "connect_args": {"connect_timeout": 5},
    }
    options.update(kwargs)
    return sa.create_engine(url, **options)


def migrate(url: str, revision: str = "head", *, down: bool = False) -> None:
    """Run the repository's Alembic migrations on `url` (upgrade, or downgrade with down)."""
    from alembic import command
    from alembic.config import Config

    root = Path(__file__).resolve().parent.parent
    config = Config(toml_file=str(root / "pyproject.toml"))
    engine = sa.create_engine(url)
    with engine.begin() as conn:
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
