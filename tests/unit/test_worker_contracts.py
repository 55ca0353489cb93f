"""Worker behaviours that had no test of their own: a hint for a job of a model this worker
does not serve claims nothing and leaves the job waiting for its own workers, retry_transient
survives a connection Postgres really dropped, and the shutdown watchdog ends a worker whose
shutdown hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import sqlalchemy as sa

from tests.helpers import ROOT
from tests.helpers import check_invariants
from tests.helpers import seed_job
from tests.helpers import wait_until
from tests.runner_harness import Harness
from tests.runner_harness import job_row
from thinkbatch.db import retry_transient
from worker.runner import EXIT_SHUTDOWN_TIMEOUT


def test_a_job_of_another_model_waits_for_its_own_workers(harness: Harness) -> None:
    runner = harness.runner()
    job_id = seed_job(harness.db, harness.settings, n=3)
    # A job stored for another model, its hint delivered here (by hand, or a stale queue).
    with harness.db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE jobs SET model = 'other/model', models = '[\"other/model\"]' WHERE id = :id"
            ),
            {"id": job_id},
        )
    outcome = runner.drive(job_id, lambda done, total: None)
    assert outcome["outcome"] == "not runnable here", outcome
    assert job_row(harness.db, job_id).status == "queued"  # not failed: it waits
    with harness.db.connect() as conn:
        items = conn.execute(
            sa.text("SELECT DISTINCT status, attempts FROM items WHERE job_id = :id"),
            {"id": job_id},
        ).all()
    assert items == [("pending", 0)]  # nothing claimed on the wrong model
    check_invariants(harness.db, job_id, finished=False)


def test_retry_transient_survives_a_connection_postgres_dropped(database_url: str) -> None:
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0, pool_pre_ping=False)
    admin = sa.create_engine(database_url)
    try:
        with engine.connect() as conn:
            victim = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar()
        # The pooled connection is now idle; the server ends its backend, as a restart would.
        with admin.begin() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": victim}).scalar()
        wait_until(lambda: not _backend_alive(admin, victim), 10, "the backend gone")
        calls: list[int] = []

        def query() -> int:
            calls.append(1)
            with engine.connect() as conn:
                return int(conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one())

        fresh = retry_transient(query, attempts=3, base_delay=0.01)
        # The first call met the dead connection; the retry got a new one from the pool.
        assert len(calls) == 2
        assert fresh != victim
    finally:
        engine.dispose()
        admin.dispose()


def _backend_alive(admin: sa.Engine, pid: int | None) -> bool:
    with admin.connect() as conn:
        found = conn.execute(
            sa.text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p"), {"p": pid}
        ).scalar()
    return bool(found)


WATCHDOG = textwrap.dedent(
    """
    import subprocess, sys
    from thinkbatch.settings import Settings
    from worker import lifecycle

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,  # the test reads ours to EOF
    )
    print(child.pid, flush=True)
    settings = Settings(_env_file=None, shutdown_timeout_s=0.5)
    lifecycle._watchdog(settings)  # as after a SIGTERM whose shutdown never finishes
    print("not reached", flush=True)
    """
)


def test_the_shutdown_watchdog_kills_the_engine_processes_and_exits() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", WATCHDOG],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,  # imports take seconds on a loaded host; the watchdog itself 0.5 s
    )
    assert proc.returncode == EXIT_SHUTDOWN_TIMEOUT, proc.stderr[-2000:]
    assert "not reached" not in proc.stdout
    assert "shutdown took longer than 0.5s" in proc.stderr
    child = int(proc.stdout.split()[0])
    try:
        # Killed, not orphaned: the engine's processes must not outlive the worker.
        wait_until(lambda: not _running(child), 10, f"child {child} gone")
    finally:
        if _running(child):
            psutil.Process(child).kill()


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
