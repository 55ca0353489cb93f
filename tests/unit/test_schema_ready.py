"""The init containers' wait (thinkbatch/schema_ready.py), on the real Postgres: it waits while a
database has no schema or an older one, and lets the pod start once the migration is done."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.helpers import ROOT
from tests.helpers import Servers
from tests.helpers import database_name
from tests.helpers import recreate_database
from thinkbatch.db import migrate
from thinkbatch.schema_ready import head_revisions
from thinkbatch.schema_ready import migrations_dir
from thinkbatch.schema_ready import status


def _wait(url: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "THINKBATCH_DATABASE_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "thinkbatch.schema_ready", "--timeout", str(timeout)],
        env=env, capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_it_waits_for_the_migration_and_then_lets_the_pod_start(servers: Servers) -> None:
    url = recreate_database(servers.postgres_admin_url, database_name("schema"))
    engine = sa.create_engine(url)
    heads = head_revisions()
    try:
        (head,) = heads
        assert status(engine, heads) == f"the database is at no schema, this code needs {head}"
        fresh = _wait(url, timeout=0.5)
        assert fresh.returncode == 1, fresh.stdout + fresh.stderr
        assert "waiting for the migration: the database is at no schema" in fresh.stdout
        migrate(url, "0003")  # an older schema: the code must still wait
        older = status(engine, heads)
        assert older and older.startswith("the database is at 0003"), older
        migrate(url)
        assert status(engine, heads) is None
        ready = _wait(url, timeout=1)
        assert ready.returncode == 0 and "ready" in ready.stdout, ready.stdout + ready.stderr
    finally:
        engine.dispose()


def test_it_waits_while_the_database_does_not_answer() -> None:
    engine = sa.create_engine("postgresql+psycopg://nobody@127.0.0.1:9/none")
    why = status(engine, head_revisions())
    assert why and why.startswith("the database does not answer yet"), why
    engine.dispose()


def test_the_migrations_are_found_beside_the_code_or_in_the_working_directory(
    tmp_path: Path,
) -> None:
    # An image installs thinkbatch into site-packages and keeps migrations/ in /app, its
    # working directory: the first place holds none, the second does.
    site, app = tmp_path / "site-packages", tmp_path / "app"
    (app / "migrations").mkdir(parents=True)
    (app / "migrations" / "env.py").write_text("")
    site.mkdir()
    assert migrations_dir((site, app)) == app / "migrations"
    assert migrations_dir() == ROOT / "migrations"  # a checkout's own
    with pytest.raises(FileNotFoundError):
        migrations_dir((site,))
