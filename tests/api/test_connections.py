"""A request never holds two of the pool's connections at once, but a batch's create.

The authentication reads the key through the request's connection. A view that then took a
connection of its own while the request still held that one would need two at once, and
as many requests as there are threads doing so, each holding one and waiting for another,
would wait on each other until the pool's timeout and answer 500. Views that read through the
request's connection are marked (`reads_request_connection`); every other view gets it back
before it runs. The API's pool has a connection for each request thread and more for a
batch's create."""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import event
from sqlalchemy.pool import QueuePool

from api.auth import KEY_COOKIE
from api.services import services
from tests.helpers import a_job_a_file_and_a_batch
from tests.helpers import get_routes
from tests.helpers import rollbacks_that_drop_prepared_statements


class Held:
    """The pooled connections each thread holds, and the most any thread held at once."""

    def __init__(self, engine: sa.Engine):
        self.now: Counter[int] = Counter()
        self.most = 0
        self.where = ""  # the stack that took the most
        self.lock = threading.Lock()
        event.listen(engine, "checkout", self.checkout)
        event.listen(engine, "checkin", self.checkin)

    def checkout(self, *_: Any) -> None:
        with self.lock:
            me = threading.get_ident()
            self.now[me] += 1
            if self.now[me] > self.most:
                self.most = self.now[me]
                self.where = "".join(traceback.format_stack(limit=30))

    def checkin(self, *_: Any) -> None:
        with self.lock:
            self.now[threading.get_ident()] -= 1


def test_no_route_holds_two_connections(app: Flask, client: FlaskClient) -> None:
    held = Held(services_engine(app))
    items = [{"custom_id": f"c{k}", "prompt": f"question {k}"} for k in range(5)]
    most: dict[str, int] = {}

    def call(method: str, path: str, **kwargs: Any) -> Any:
        held.most = 0
        response = client.open(path, method=method, **kwargs)
        assert response.status_code < 500, (path, response.text)
        response.get_data()  # a streamed body runs to its end here
        most[f"{method} {path}"] = held.most
        return response.json

    job_id, file_id, batch_id = a_job_a_file_and_a_batch(call, items)
    for method, path in (
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/items"),
        ("GET", f"/v1/jobs/{job_id}/results"),
        ("GET", "/v1/jobs"),
        ("GET", "/v1/files"),
        ("GET", f"/v1/files/{file_id}"),
        ("GET", f"/v1/files/{file_id}/content"),
        ("GET", "/v1/batches"),
        ("GET", f"/v1/batches/{batch_id}"),
        ("GET", "/v1/models"),
        ("POST", f"/v1/batches/{batch_id}/cancel"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
    ):
        call(method, path)
    # A batch's create reads its input file while its items are copied in: two at once.
    assert most.pop("POST /v1/batches") == 2
    assert set(most.values()) == {1}, f"{most}\n{held.where}"
    assert sum(held.now.values()) == 0  # every one given back


def test_no_read_ends_in_a_rollback_that_drops_the_pools_prepared_statements(
    app: Flask, client: FlaskClient
) -> None:
    """psycopg drops every prepared statement of a connection when a transaction on it rolls
    back (and Postgres then plans the status call's statement for its values five times over
    on that connection, some 300 us each: tests/unit/test_plan_reuse.py). Every GET route
    shares the pool with the status calls; none may roll back a transaction it opened."""
    engine = services_engine(app)
    path = [""]
    answered: list[int] = []

    def call(method: str, url: str, **kwargs: Any) -> Any:
        path[0] = f"{method} {url}"
        response = client.open(url, method=method, **kwargs)
        answered.append(response.status_code)
        assert response.status_code < 500, (url, response.text)
        response.get_data()  # a streamed body runs to its end here
        return response.json if response.is_json else None

    items = [{"custom_id": f"c{k}", "prompt": f"question {k}"} for k in range(5)]
    job_id, file_id, batch_id = a_job_a_file_and_a_batch(call, items)
    ids = {"job_id": job_id, "file_id": file_id, "batch_id": batch_id}
    # The dashboard's pages read with the key its login left in a cookie.
    client.set_cookie(KEY_COOKIE, client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    called = []
    with rollbacks_that_drop_prepared_statements(engine, lambda: path[0]) as dropping:
        for rule, url in get_routes(app, ids):
            called.append(rule)
            call("GET", url)
            assert answered[-1] == 200, (url, answered[-1])  # it read what it serves
    assert {
        "/v1/jobs/<job_id>/results",
        "/v1/files/<file_id>/content",
        "/readyz",
        "/jobs/<job_id>",
    } <= set(called)
    assert not dropping, "\n".join(dropping)


def test_the_pool_holds_a_connection_for_each_request_thread_and_more(
    make_app: Callable[..., Flask],
) -> None:
    engine = services_engine(make_app(api_threads=7, api_bulk_threads=2, db_pool_size=3))
    pool = engine.pool
    assert isinstance(pool, QueuePool)
    assert pool.size() == 7 + 2 and pool._max_overflow == 3


def services_engine(app: Flask) -> sa.Engine:
    with app.app_context():
        return services().engine


def test_a_connection_lost_after_its_checkout_is_a_503_and_the_next_request_works(
    app: Flask, client: FlaskClient, db: sa.Engine
) -> None:
    """The request's first statement, the key's (a prepared read on the driver's cursor),
    finds its connection dead: the answer is the envelope's 503 `database_unavailable`, as
    for any statement through SQLAlchemy, and the dead connection is not handed out again."""
    engine = services_engine(app)
    ended: list[int] = []

    def end_it(dbapi_connection: Any, *_: Any) -> None:
        # After the pool's own liveness check: the connection went out alive.
        if ended:
            return
        pid = dbapi_connection.info.backend_pid
        with db.connect() as other:
            other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        ended.append(pid)

    event.listen(engine, "checkout", end_it)
    try:
        missing = "/v1/jobs/00000000-0000-0000-0000-000000000000"
        lost = client.get(missing)
        assert lost.status_code == 503, lost.text
        assert lost.json is not None and lost.json["error"]["code"] == "database_unavailable"
        assert ended
        assert client.get(missing).status_code == 404  # a working connection, the key read
    finally:
        event.remove(engine, "checkout", end_it)
