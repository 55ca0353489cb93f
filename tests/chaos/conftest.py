"""Chaos suite fixtures: private PostgreSQL and Redis servers (so they can be restarted) and a
real API. The report line per scenario is printed at the end of the run by tests/conftest.py."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from tests.chaos.helpers import Chaos
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import Client
from tests.stacks import api_key
from tests.stacks import build_demo_model
from tests.stacks import make_stack
from thinkbatch.db import migrate


@pytest.fixture(scope="session")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chaos]:
    build_demo_model()
    root = tmp_path_factory.mktemp("chaos")
    # Its data folder outside pytest's: a pytest started anywhere on the machine meanwhile (a
    # `make check` beside `make test`) takes the other users' access to pytest's temporary
    # root away, and this server runs as another user when the tests run as root.
    scratch = Path(tempfile.mkdtemp(prefix="thinkbatch-chaos-"))
    scratch.chmod(0o755)
    pg = LocalPostgres(scratch / "pg", fast=True).start()
    redis_server = LocalRedis(root / "redis").start()
    url = pg.create_database("chaos")
    migrate(url)
    stack = make_stack(root / "api", url, redis_server.url(0), **FAST_RECOVERY_ENV)
    api = stack.start_api()
    assert api.port is not None
    db = sa.create_engine(url, pool_pre_ping=True)
    try:
        with Client(api.port, api_key(url)) as client:
            yield Chaos(pg, redis_server, url, db, stack, client, root)
    finally:
        stack.stop_all()
        db.dispose()
        redis_server.stop()
        pg.stop()
        shutil.rmtree(scratch, ignore_errors=True)
