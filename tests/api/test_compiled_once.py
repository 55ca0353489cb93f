"""No read route compiles SQL on a call after its first.

SQLAlchemy compiles a statement it executes once and keeps the result in its compiled cache;
a statement compiled by hand (`select.compile()`) is compiled again at every call, some 1.5 ms
of the API's CPU for a results download's statement. Every GET route here, and the filters of
the job's pages and downloads, is called once to warm up, then again: the second call must
compile nothing."""

from __future__ import annotations

from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy.sql import compiler

from api.auth import KEY_COOKIE
from tests.helpers import a_job_a_file_and_a_batch
from tests.helpers import get_routes


def test_no_get_route_compiles_sql_after_its_first_call(
    app: Flask, client: FlaskClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    compiled: list[str] = []
    compile_once = compiler.Compiled.__init__

    def counted(self: compiler.Compiled, *args: Any, **kwargs: Any) -> None:
        compile_once(self, *args, **kwargs)
        compiled.append(type(self).__name__)

    monkeypatch.setattr(compiler.Compiled, "__init__", counted)

    def call(method: str, url: str, **kwargs: Any) -> Any:
        response = client.open(url, method=method, **kwargs)
        assert response.status_code in ((200, 201) if method == "POST" else (200,)), url
        response.get_data()  # a streamed body runs to its end here
        return response.json if response.is_json else None

    items = [{"custom_id": f"c{k}", "prompt": f"question {k}"} for k in range(5)]
    job_id, file_id, batch_id = a_job_a_file_and_a_batch(call, items)
    client.set_cookie(KEY_COOKIE, client.environ_base["HTTP_AUTHORIZATION"].split()[1])
    urls = [url for _, url in get_routes(app, {"job_id": job_id, "file_id": file_id,
                                                "batch_id": batch_id})]  # fmt: skip
    job = f"/v1/jobs/{job_id}"
    urls += [
        f"{job}/items?status=pending",
        f"{job}/items?after=c1",
        f"{job}/items?include_thinking=false",
        f"{job}/results?status=pending",
        f"{job}/results?include_thinking=false",
    ]
    assert f"{job}/results" in urls and "/v1/batches" in urls
    for url in urls:
        call("GET", url)
    compiling = {}
    for url in urls:
        compiled.clear()
        call("GET", url)
        if compiled:
            compiling[url] = list(compiled)
    assert compiling == {}
