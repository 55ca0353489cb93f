"""Database engine and sessions, built from Settings. Shared by the API, the worker and tools."""

from __future__ import annotations

import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from typing import TypeVar
from typing import cast

import psycopg
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy import exc
from sqlalchemy import orm
from sqlalchemy.dialects.postgresql import psycopg as postgresql_psycopg
from sqlalchemy.pool import NullPool
from sqlalchemy.sql.compiler import SQLCompiler

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
        # A restarted Postgres leaves dead connections in the pool: `_check_on_checkout`
        # tests each one before use, with a round trip only where there is a reason to.
        "pool_pre_ping": False,
        "pool_size": settings.db_pool_size,
        "max_overflow": settings.db_pool_size,
        "connect_args": {"connect_timeout": 5, **peer.connect_args()},
    }
    options.update(kwargs)
    if options.get("poolclass") is NullPool:  # a connection per use: no pool to size
        options.pop("pool_size", None)
        options.pop("max_overflow", None)
    engine = sa.create_engine(url, **options)
    # Set on each new connection, not passed as a startup `options` parameter: connection
    # poolers (PgBouncer) refuse unknown startup parameters unless told to ignore them.
    statement = peer.server_settings()

    @event.listens_for(engine, "connect")
    def _bound_dead_peers(dbapi_connection: Any, record: Any) -> None:
        with dbapi_connection.cursor() as cursor:
            cursor.execute(statement)
        dbapi_connection.commit()
        record.info[_RETURNED] = time.monotonic()

    _check_on_checkout(engine, settings.db_ping_after_idle_s)
    return engine


_RETURNED = "thinkbatch_returned_at"


def needs_ping(dbapi_connection: Any, returned_at: float | None, idle_s: float) -> bool:
    """Whether a pooled connection must prove it is alive by a round trip before it is used.

    A connection back in the pool a moment ago is known to work, unless the server has said
    something since: a server that ends a session (a restart, pg_terminate_backend, an idle
    timeout) sends its reason and closes the socket, and either makes the socket readable. A
    connection idle for longer than `idle_s` (0: every time) is pinged anyway, for the ends
    that go silently (a link that dropped, a proxy that forgot the session)."""
    if returned_at is None or idle_s <= 0 or time.monotonic() - returned_at > idle_s:
        return True
    if dbapi_connection.closed:
        return True
    try:
        socket = dbapi_connection.pgconn.socket
    except psycopg.OperationalError:  # libpq has no socket for it: broken
        return True
    # poll, not select: a process with many files open (a worker's engine) may hold this
    # socket past select's limit of 1024.
    poller = select.poll()
    poller.register(socket, select.POLLIN)
    return bool(poller.poll(0))


def ping(dbapi_connection: Any) -> None:
    """One round trip; raises if the connection is dead."""
    dbapi_connection.execute("SELECT 1").close()
    if dbapi_connection.info.transaction_status != 0:  # not in autocommit: leave it idle
        # By a commit, which for this read is what a rollback is: a rollback drops every
        # prepared statement of the connection (psycopg; `reads` below).
        dbapi_connection.commit()


def _check_on_checkout(engine: sa.Engine, idle_s: float) -> None:
    """SQLAlchemy's pre-ping pays a round trip on every checkout: a poll of the API that runs
    two statements ran three, and a worker's claims and stores paid one more each. Here a
    connection is pinged only where needs_ping() says so; a dead one is replaced, as the
    pool replaces any connection a checkout listener calls disconnected."""

    @event.listens_for(engine, "checkout")
    def _test_before_use(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        if not needs_ping(dbapi_connection, record.info.get(_RETURNED), idle_s):
            return
        try:
            ping(dbapi_connection)
        except Exception as error:
            # As pool_pre_ping does: the pool's other connections of the same age are taken
            # for dead too and replaced at their next checkout, and this one now.
            raise exc.InvalidatePoolError(f"a pooled connection was dead: {error}") from error

    @event.listens_for(engine, "checkin")
    def _returned(_dbapi_connection: Any, record: Any) -> None:
        record.info[_RETURNED] = time.monotonic()


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


def reads(engine: sa.Engine) -> sa.Engine:
    """The engine's pool for reads: each statement its own transaction, so that no read ends
    in a rollback. psycopg drops every prepared statement of a connection when a transaction
    on it rolls back, and Postgres then plans the statements that run many times a second (a
    poll's, a worker's claims and stores) for each execution again until they are prepared
    anew and a generic plan is chosen: about ten executions on each pooled connection
    (tests/unit/test_plan_reuse.py). A read that needs one snapshot for several statements
    takes a transaction and ends it with a commit."""
    return engine.execution_options(isolation_level="AUTOCOMMIT")


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


class Prepared:
    """A read run many times a second (a poll's key and job): SQLAlchemy's statement, compiled
    once, run on the driver's own cursor as a server-side prepared statement, its row the plain
    tuple psycopg makes. Through SQLAlchemy's execute the same statement cost about 60 us of
    CPU against 10 here (`python -m bench.poll_cpu` measures the whole call). Only for
    statements whose columns need no result processing of SQLAlchemy's (an enum comes back
    as its text)."""

    def __init__(self, statement: sa.ClauseElement):
        # psycopg's dialect: the driver every engine of make_engine() uses.
        dialect = postgresql_psycopg.dialect()  # type: ignore[no-untyped-call]
        compiled = cast(SQLCompiler, statement.compile(dialect=dialect))
        self.sql = str(compiled)
        # The values the statement binds itself; the caller's come in first().
        self.defaults: dict[str, Any] = dict(compiled.construct_params(_check=False))

    def first(self, conn: sa.Connection | orm.Session, **params: object) -> tuple[Any, ...] | None:
        rows = self.all(conn, **params)
        return rows[0] if rows else None

    def all(self, conn: sa.Connection | orm.Session, **params: object) -> list[tuple[Any, ...]]:
        """The rows, on `conn` (a Session's pending changes are not flushed first)."""
        if isinstance(conn, orm.Session):
            conn = conn.connection()  # begins the Session's transaction, as execute would
        driver = conn.connection.driver_connection
        assert driver is not None
        if not driver.autocommit and not conn.in_transaction():
            conn.begin()  # the transaction the driver opens is then SQLAlchemy's to end
        values = {**self.defaults, **params}
        try:
            with driver.cursor() as cursor:
                cursor.execute(self.sql, values, prepare=True)
                rows: list[tuple[Any, ...]] = cursor.fetchall()
        except psycopg.Error as error:
            raise self._as_sqlalchemy_raises(conn, driver, values, error) from error
        return rows

    def _as_sqlalchemy_raises(
        self, conn: sa.Connection, driver: Any, values: dict[str, Any], error: psycopg.Error
    ) -> exc.StatementError:
        """The driver's error as SQLAlchemy's execute raises it (an OperationalError for a lost
        connection), with a lost connection invalidated: the API answers it 503 and
        retry_transient retries it, as for any other statement."""
        gone = bool(conn.dialect.is_disconnect(error, driver, None))  # type: ignore[arg-type]
        if gone and not conn.invalidated:
            conn.invalidate(error)
        return exc.DBAPIError.instance(
            self.sql,
            values,
            error,
            psycopg.Error,
            connection_invalidated=gone,
            dialect=conn.dialect,
        )
