"""`local_stack()`: thinkbatch on one machine for the demo, the benchmarks and `make gpu-check`.

It starts the embedded PostgreSQL and Redis the settings do not point elsewhere, migrates, and
(for the demo and the benchmark) builds the demo model; it yields a handle whose `stack` starts
the API, workers and Flower. On the way out, also on Ctrl-C, SIGTERM, SIGHUP or an exception,
it stops every process the stack started, then every service it started, each bounded by a
timeout that ends in SIGKILL.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from types import FrameType
from typing import Any

from devstack.demo_model import build_demo_model
from devstack.demo_model import demo_model_env
from devstack.demo_model import wants_demo_model
from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from devstack.stack import Stack
from devstack.stack import child_settings
from devstack.stack import engine_env
from thinkbatch.db import migrate
from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings

# Stopped by a service manager or a container runtime (SIGTERM), or by the terminal going away
# (SIGHUP): tear down as on Ctrl-C. Python's default for these ends the process at once, which
# skips every `finally` and leaves the services, each in its own session, running.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass
class LocalStack:
    stack: Stack
    settings: Settings  # as the stack's processes read them (URLs and model filled in)
    env: dict[str, str]  # what the processes get on top of this process's environment
    services: list[LocalPostgres | LocalRedis] = field(default_factory=list)

    @property
    def database_url(self) -> str:
        return self.settings.require_database_url()

    @property
    def redis_url(self) -> str:
        return self.settings.require_redis_url()


def _quiet(line: str) -> None:
    pass


@contextmanager
def local_stack(
    data_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    database: str = "thinkbatch",
    engine: bool = True,
    cpu_overrides: Mapping[str, str] | None = None,
    demo_model: bool = True,
    say: Callable[[str], None] = _quiet,
) -> Iterator[LocalStack]:
    """Services and data under `data_dir` (PostgreSQL in `postgres/`, Redis in `redis/`, the
    processes' logs in `logs/`); a service starts only where the settings name no URL. `env`:
    further settings of the processes (THINKBATCH_ names). `engine`: the CPU engine defaults
    when there is no GPU (`cpu_overrides` over them). `demo_model`: build and serve the demo
    model unless the settings name another model."""
    settings = child_settings(env or {})
    data_dir = Path(data_dir).absolute()
    child_env: dict[str, str] = {**(engine_env(cpu_overrides) if engine else {}), **(env or {})}
    services: list[LocalPostgres | LocalRedis] = []
    stack: Stack | None = None
    previous = _catch_stop_signals()
    try:
        # Each service is recorded before it starts, so that a stop signal arriving mid-start
        # still stops it (stopping one that never came up does nothing).
        if settings.database_url is None:
            say(f"starting PostgreSQL (embedded) in {data_dir / 'postgres'}")
            pg = LocalPostgres(data_dir / "postgres")
            services.append(pg)
            child_env[f"{ENV_PREFIX}DATABASE_URL"] = pg.start().create_database(database)
        if settings.redis_url is None:
            say("starting Redis (embedded)")
            redis_server = LocalRedis(data_dir / "redis")
            services.append(redis_server)
            child_env[f"{ENV_PREFIX}REDIS_URL"] = redis_server.start().url(0)
        say("migrating the database")
        handle_settings = child_settings(child_env)
        migrate(handle_settings.require_database_url())
        if demo_model and wants_demo_model(settings):
            say("building the tiny demo model (once; cached)")
            child_env.update(demo_model_env(build_demo_model()))
            handle_settings = child_settings(child_env)
        stack = Stack(child_env, data_dir / "logs")
        yield LocalStack(stack, handle_settings, child_env, services)
    finally:
        _ignore_stop_signals()
        try:
            stop_all(stack, services, say)
        finally:
            _restore(previous)


def stop_all(
    stack: Stack | None, services: list[LocalPostgres | LocalRedis], say: Callable[[str], None]
) -> None:
    if stack is not None:
        stack.stop_all()
    for service in reversed(services):
        try:
            service.stop()
        except Exception as error:  # noqa: BLE001 - stop the others all the same
            say(f"could not stop {type(service).__name__}: {error}")


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _in_main_thread() -> bool:
    # Signal handlers can only be set from the main thread.
    return threading.current_thread() is threading.main_thread()


def _catch_stop_signals() -> dict[int, Any]:
    if not _in_main_thread():
        return {}
    previous: dict[int, Any] = {
        sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)
    }
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_on_signal)
    return previous


def _ignore_stop_signals() -> None:
    # A second signal (an impatient Ctrl-C, systemd repeating SIGTERM) must not cut the
    # teardown short; each stop is bounded by its own timeout and ends in SIGKILL.
    if _in_main_thread():
        for sig in (*STOP_SIGNALS, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)


def _restore(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
