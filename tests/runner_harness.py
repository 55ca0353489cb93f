"""The in-process runner harness: a Runner on the fake engine against the tests' database, the
`harness` fixture (registered by conftest's pytest_plugins), and waits with deadlines."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from typing import TypeVar

import pytest
import sqlalchemy as sa

from tests.helpers import JOB_ROW
from tests.helpers import make_settings
from thinkbatch.settings import Settings
from worker.engine import create_engine
from worker.runner import Runner

T = TypeVar("T")


class Harness:
    def __init__(self, settings: Settings, db: sa.Engine):
        self.settings = settings
        self.db = db
        self.published: list[uuid.UUID] = []
        self.runners: list[Runner] = []

    def runner(
        self,
        publish: Callable[[uuid.UUID], bool] | None = None,
        publish_here: Callable[[uuid.UUID], bool] | None = None,
        **overrides: Any,
    ) -> Runner:
        settings = self.settings.model_copy(update=overrides) if overrides else self.settings
        runner = Runner(
            settings,
            engine=create_engine(settings),
            db=self.db,
            publish=publish or (lambda job_id: self.published.append(job_id) or True),
            publish_here=publish_here,
        )
        runner.start()
        self.runners.append(runner)
        return runner

    def drive(self, runner: Runner, job_id: uuid.UUID) -> tuple[threading.Thread, list[Any]]:
        reports: list[Any] = []
        thread = threading.Thread(
            target=lambda: reports.append(runner.drive(job_id, lambda d, t: reports.append((d, t))))
        )
        thread.start()
        return thread, reports

    def close(self) -> None:
        for runner in self.runners:
            close_runner(runner)


@contextmanager
def sampled(read: Callable[[], T | None], every_s: float = 0.005) -> Iterator[list[T]]:
    """What `read` returns (None: nothing to record), taken on a thread every `every_s` while
    the block runs; the list fills as it goes."""
    samples: list[T] = []
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            value = read()
            if value is not None:
                samples.append(value)
            done.wait(every_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        done.set()
        thread.join()


def close_runner(runner: Runner, timeout: float = 5) -> None:
    """Runner.close stops its event loop and leaves closing it to the process's exit; a test
    process lives on, so the loop is closed here (else it is reported unclosed when collected),
    the way asyncio.run ends one: its leftover tasks cancelled first."""
    thread, loop = runner.engine_loop.thread, runner.engine_loop.loop
    if thread.is_alive():
        runner.close(timeout=timeout)
        thread.join(5)
    if thread.is_alive():
        return  # a hung loop fails its test elsewhere; closing a running loop would raise
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:  # (an empty gather would belong to another loop)
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


@pytest.fixture
def harness(database_url: str, redis_url: str, db: sa.Engine) -> Iterator[Harness]:
    settings = make_settings(database_url, redis_url, engine_extra_args={"step_s": 0.002})
    h = Harness(settings, db)
    yield h
    h.close()


def job_row(db: sa.Engine, job_id: uuid.UUID) -> Any:
    with db.connect() as conn:
        return conn.execute(JOB_ROW, {"id": job_id}).one()


def wait_status(db: sa.Engine, job_id: uuid.UUID, statuses: set[str], timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = job_row(db, job_id)
        if row.status in statuses:
            return row
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still {job_row(db, job_id).status}")
