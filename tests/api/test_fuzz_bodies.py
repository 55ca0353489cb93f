"""Every route that takes a body or a file, fed arbitrary bytes, arbitrary JSON (numbers of any
length included) and mutations of valid requests: the answer is a 2xx or a 4xx in the envelope,
never a 5xx, and a 4xx stores nothing."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.helpers import TENANT
from tests.helpers import keyed_client
from tests.helpers import make_key

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
# A number as raw JSON text, of any length: json.dumps cannot write one past 4,300 digits.
RAW_NUMBERS = st.builds(
    lambda sign, digits, tail: (sign + digits + tail).encode(),
    st.sampled_from(["", "-"]),
    st.one_of(
        st.text(alphabet="0123456789", min_size=1, max_size=30),
        st.integers(4000, 6000).map(lambda n: "7" * n),  # around Python's 4,300-digit limit
    ),
    st.sampled_from(["", ".5", "e999", "e-999", "E+20"]),
)

VALID_JOB = {
    "model": "thinkbatch-demo",
    "params": {"max_tokens": 16, "temperature": 0.5, "stop": ["x"]},
    "metadata": {"k": "v"},
    "items": [
        {"custom_id": "a", "prompt": "hi"},
        {"custom_id": "b", "messages": [{"role": "user", "content": "hi"}],
         "params": {"enable_thinking": False, "thinking_budget": 4}},
    ],
}  # fmt: skip
VALID_LINE = {
    "custom_id": "c1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {
        "model": "thinkbatch-demo",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 8,
        "chat_template_kwargs": {"enable_thinking": True},
    },
}
VALID_CREATE = {
    "endpoint": "/v1/chat/completions",
    "completion_window": "24h",
    "metadata": {"a": "b"},
    "output_expires_after": {"anchor": "created_at", "seconds": 3600},
}


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    """The valid request with one node replaced, removed or given a sibling; or with a raw
    number of any length in place of a value."""
    doc = json.loads(json.dumps(valid))
    paths: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> None:
        paths.append(path)
        if isinstance(node, dict):
            for key, child in node.items():
                walk(child, [*path, key])
        elif isinstance(node, list):
            for index, child in enumerate(node):
                walk(child, [*path, index])

    walk(doc, [])
    path = draw(st.sampled_from(paths[1:]))
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    action = draw(st.sampled_from(["replace", "remove", "add", "number"]))
    marker = "\x01NUMBER\x01"
    if action == "replace":
        parent[path[-1]] = draw(JSON_VALUES)
    elif action == "remove":
        del parent[path[-1]]
    elif action == "add" and isinstance(parent, dict):
        parent[draw(st.text(max_size=12))] = draw(JSON_VALUES)
    else:
        parent[path[-1]] = marker
    text = json.dumps(doc).encode()
    return text.replace(json.dumps(marker).encode(), draw(RAW_NUMBERS))


def bodies(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=300),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        RAW_NUMBERS.map(lambda n: b'{"a":' + n + b"}"),
        mutated(valid),
    )


FUZZ = hsettings(
    deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@pytest.fixture
def fuzz_client(make_app: Callable[..., Flask], db: sa.Engine) -> FlaskClient:
    app = make_app(tenant_jobs_per_minute=100_000, max_request_bytes=1024 * 1024)
    return keyed_client(app, make_key(db, TENANT))


def _stored(db: sa.Engine) -> tuple[int, ...]:
    with db.connect() as conn:
        return tuple(
            conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one()  # noqa: S608
            for table in ("jobs", "items", "files", "file_chunks")
        )


def _answered(response: Any, db: sa.Engine, before: tuple[int, ...]) -> None:
    assert response.status_code < 500, response.data[:500]
    if response.status_code >= 400:
        assert set(response.json["error"]) == {"type", "code", "message", "param"}
        assert _stored(db) == before


@FUZZ
@given(body=bodies(VALID_JOB))
def test_job_submit(fuzz_client: FlaskClient, db: sa.Engine, body: bytes) -> None:
    before = _stored(db)
    response = fuzz_client.post("/v1/jobs", data=body, content_type="application/json")
    _answered(response, db, before)


@FUZZ
@given(body=bodies(VALID_CREATE))
def test_batch_create(fuzz_client: FlaskClient, db: sa.Engine, body: bytes) -> None:
    data = json.dumps(VALID_LINE).encode() + b"\n"
    upload = fuzz_client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
        content_type="multipart/form-data",
    )
    file_id = upload.json["id"].encode()
    body = body.replace(b'"endpoint"', b'"input_file_id":"' + file_id + b'","endpoint"', 1)
    before = _stored(db)
    response = fuzz_client.post("/v1/batches", data=body, content_type="application/json")
    _answered(response, db, before)


@FUZZ
@given(
    lines=st.lists(st.one_of(bodies(VALID_LINE), st.just(json.dumps(VALID_LINE).encode())),
                   min_size=1, max_size=4),
    newline=st.sampled_from([b"\n", b"\r\n"]),
    bom=st.booleans(),
)  # fmt: skip
def test_batch_input_lines(
    fuzz_client: FlaskClient, db: sa.Engine, lines: list[bytes], newline: bytes, bom: bool
) -> None:
    data = (b"\xef\xbb\xbf" if bom else b"") + newline.join(lines)
    upload = fuzz_client.post(
        "/v1/files",
        data={"purpose": "batch", "file": (io.BytesIO(data), "in.jsonl")},
        content_type="multipart/form-data",
    )
    assert upload.status_code == 200, upload.json
    before = _stored(db)
    create = {"input_file_id": upload.json["id"], **VALID_CREATE}
    response = fuzz_client.post("/v1/batches", json=create)
    _answered(response, db, before)
    if response.status_code == 200 and response.json["status"] == "failed":
        assert _stored(db)[1] == before[1]  # a refused file stores no item
        for error in response.json["errors"]["data"]:
            assert error["line"] is None or 1 <= error["line"] <= data.count(b"\n") + 1


@FUZZ
@given(
    content=st.binary(max_size=300),
    filename=st.text(max_size=300),
    fields=st.dictionaries(
        st.sampled_from(["purpose", "expires_after[anchor]", "expires_after[seconds]", "x"]),
        st.text(max_size=30),
    ),
)
def test_file_upload(
    fuzz_client: FlaskClient, db: sa.Engine, content: bytes, filename: str, fields: dict[str, str]
) -> None:
    before = _stored(db)
    response = fuzz_client.post(
        "/v1/files",
        data={**fields, "file": (io.BytesIO(content), filename)},
        content_type="multipart/form-data",
    )
    _answered(response, db, before)


@FUZZ
@given(body=st.binary(max_size=600))
def test_raw_multipart_bodies(fuzz_client: FlaskClient, db: sa.Engine, body: bytes) -> None:
    before = _stored(db)
    response = fuzz_client.post(
        "/v1/files", data=body, content_type="multipart/form-data; boundary=b"
    )
    _answered(response, db, before)


@FUZZ
@given(body=bodies({"reason": "x"}), route=st.sampled_from(["jobs", "batches"]))
def test_cancel(fuzz_client: FlaskClient, db: sa.Engine, body: bytes, route: str) -> None:
    job = fuzz_client.post("/v1/jobs", json={"items": [{"prompt": "x"}]}).json["id"]
    target = job if route == "jobs" else "batch_" + job.replace("-", "")
    before = _stored(db)
    response = fuzz_client.post(
        f"/v1/{route}/{target}/cancel", data=body, content_type="application/json"
    )
    assert response.status_code < 500, response.data[:300]
    if response.status_code >= 400:
        assert _stored(db) == before
