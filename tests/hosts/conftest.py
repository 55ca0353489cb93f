"""Multi-host tier fixtures: the network of namespaces (tests/hosts/netns.py), private
PostgreSQL and Redis servers and the API in the services' namespace (tests/reports.py prints
the report line per scenario). Everything made here is removed at the end, also when a
test fails; what a killed run left behind is removed at the start of the next."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from tests.hosts import netns
from tests.hosts.helpers import Lab
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import Client
from tests.stacks import api_key
from tests.stacks import build_demo_model
from tests.stacks import make_stack
from thinkbatch.db import migrate


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    why = netns.available()
    if why is not None:
        pytest.skip(f"the multi-host tier {why}")
    netns.remove_leftovers()
    build_demo_model()
    root = tmp_path_factory.mktemp("hosts")
    # Each part is undone in reverse order, every one of them even when another fails: the
    # network last, which also ends whatever still runs inside it.
    with contextlib.ExitStack() as undo:
        network = netns.Network(hosts=3)
        undo.callback(network.down)
        network.up()
        scratch = netns.scratch_dir(network.prefix)
        undo.callback(shutil.rmtree, scratch, ignore_errors=True)
        pg = LocalPostgres(
            scratch / "pg",
            fast=True,
            listen=f"127.0.0.1,{netns.DB_ADDR}",
            netns=network.svc,
            trust=(f"{netns.SUBNET}.0/24",),
        )
        undo.callback(pg.stop, mode="immediate")  # a fast stop waits on a cut host's sessions
        pg.start()
        redis_server = LocalRedis(
            root / "redis", listen=("127.0.0.1", netns.REDIS_ADDR), netns=network.svc
        )
        undo.callback(redis_server.stop)
        redis_server.start()
        pg.create_database("hosts")
        url = pg.socket_url("hosts")
        migrate(url)
        # The API runs beside the servers (it is no host under test) and listens on a Unix
        # socket, the tests' way in.
        stack = make_stack(
            root / "api", pg.url("hosts"), redis_server.url(0), network.svc, **FAST_RECOVERY_ENV
        )
        undo.callback(stack.stop_all)
        stack.start_api(unix_socket=root / "api.sock")
        db = sa.create_engine(url, pool_pre_ping=True)
        undo.callback(db.dispose)
        client = undo.enter_context(Client(None, api_key(url), uds=root / "api.sock"))
        yield Lab(network, pg, redis_server, url, db, client, root)
