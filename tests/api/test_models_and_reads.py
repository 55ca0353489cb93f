"""The job's model as a submit decides it and as the reads show it, the batch routes' own errors
and headers, requests that take no fields, and query values that are empty."""

from __future__ import annotations

import io
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import TENANT
from tests.helpers import keyed_client
from tests.helpers import make_key

SERVED = ["thinkbatch-demo", "big", "lora-a"]


def _line(custom_id: str, model: str | None, **extra: Any) -> bytes:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], **extra}
    if model is not None:
        body["model"] = model
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return json.dumps(line).encode()


def _file(client: FlaskClient, lines: list[bytes]) -> str:
    upload = (io.BytesIO(b"\n".join(lines)), "batch.jsonl")
    made = client.post("/v1/files", data={"purpose": "batch", "file": upload})
    assert made.status_code == 200, made.json
    return str(made.json["id"])


def _spec(file_id: str) -> dict[str, str]:
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}  # fmt: skip


def _served(make_app: Callable[..., Flask], db: sa.Engine, served: list[str]) -> FlaskClient:
    return keyed_client(make_app(served_models=served), make_key(db, TENANT))


# --- the job's model ------------------------------------------------------------------------


def test_items_that_name_no_model_are_refused_when_the_default_is_not_served(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    client = _served(make_app, db, ["big"])
    for body in (
        {"items": [{"prompt": "a"}]},
        {"items": [{"prompt": "a", "model": "big"}, {"prompt": "b"}]},
        {"items": [{"prompt": "a"}], "params": {"max_tokens": 8}},
    ):
        answer = client.post("/v1/jobs", json=body)
        assert answer.status_code == 400, answer.json
        error = answer.json["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "'thinkbatch-demo'" in error["message"] and "'big'" in error["message"]
    # Nothing was stored by the refusals; a job whose items all name a served model is taken.
    assert client.get("/v1/jobs").json["data"] == []
    named = client.post("/v1/jobs", json={"items": [{"prompt": "a", "model": "big"}]})
    assert named.status_code == 201 and named.json["model"] == "big"
    assert (
        client.post("/v1/jobs", json={"model": "big", "items": [{"prompt": "a"}]}).status_code
        == 201
    )


def test_a_batch_line_without_a_model_is_refused_alone(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    client = _served(make_app, db, ["big"])
    lines = [_line("a", None), _line("b", "big")]
    batch = client.post("/v1/batches", json=_spec(_file(client, lines)))
    assert batch.status_code == 200, batch.json
    records = client.get(f"/v1/jobs/{batch.json['id']}/items").json["data"]
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["a"]["status"] == "failed"
    assert by_id["a"]["error"]["code"] == "missing_required_parameter"
    assert by_id["b"]["status"] == "pending" and batch.json["model"] == "big"


def test_a_job_whose_items_all_name_models_is_shown_with_the_one_most_name(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    client = _served(make_app, db, SERVED)
    items = [{"prompt": "a", "model": "lora-a"}, {"prompt": "b", "model": "big"},
             {"prompt": "c", "model": "big"}]  # fmt: skip
    job = client.post("/v1/jobs", json={"items": items}).json
    assert job["model"] == "big"
    tie = client.post("/v1/jobs", json={"items": items[:2]}).json
    assert tie["model"] == "big"  # a tie: the first name in order
    # Items that name none run on the deployment's model, which the job then shows.
    mixed = client.post("/v1/jobs", json={"items": [*items, {"prompt": "d"}]}).json
    assert mixed["model"] == "thinkbatch-demo"
    batch = client.post(
        "/v1/batches", json=_spec(_file(client, [_line("a", "lora-a"), _line("b", "big")]))
    ).json
    assert batch["model"] in ("big", "lora-a")


def test_a_refused_line_shows_the_model_it_named(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    client = _served(make_app, db, SERVED)
    lines = [_line("a", "lora-a"), _line("b", "big", temperature=99)]
    batch = client.post("/v1/batches", json=_spec(_file(client, lines))).json
    records = client.get(f"/v1/jobs/{batch['id']}/items").json["data"]
    by_id = {r["custom_id"]: r for r in records}
    assert by_id["b"]["status"] == "failed" and by_id["b"]["model"] == "big"
    assert by_id["a"]["model"] == "lora-a"
    # The refused line's model is shown, never run: only the line that runs counts.
    job = client.get(f"/v1/jobs/{batch['id']}").json
    assert job["counts"]["pending"] == 1 and job["counts"]["failed"] == 1


# --- times on one clock -------------------------------------------------------------------------


def test_a_batch_refused_whole_never_finishes_before_it_was_created(
    client: FlaskClient, db: sa.Engine
) -> None:
    """The submit waits for its tenant's lock: the job's creation is the transaction's time on
    the database's clock, as its end is."""
    file_id = _file(client, [_line("a", "thinkbatch-demo", temperature=99)])
    answer: dict[str, Any] = {}
    with db.connect() as conn, conn.begin():
        conn.execute(
            sa.text("SELECT pg_advisory_xact_lock(hashtextextended(:k, 0))"),
            {"k": f"thinkbatch-tenant:{TENANT}"},
        )
        submit = threading.Thread(
            target=lambda: answer.setdefault("r", client.post("/v1/batches", json=_spec(file_id)))
        )
        submit.start()
        time.sleep(1.2)
    submit.join()
    batch = answer["r"].json
    assert batch["status"] in ("completed", "failed"), batch
    assert batch["created_at"] <= (batch["completed_at"] or batch["failed_at"])
    job = client.get(f"/v1/jobs/{batch['id']}").json
    assert job["created_at"] <= job["finished_at"]
    item = client.get(f"/v1/jobs/{batch['id']}/items").json["data"][0]
    assert job["created_at"] <= item["finished_at"]


# --- the batch routes' own errors and headers ---------------------------------------------


def test_a_batch_that_is_not_one_is_a_batch_not_found_naming_the_id_asked_for(
    client: FlaskClient, rival: FlaskClient
) -> None:
    native = client.post("/v1/jobs", json={"items": [{"prompt": "a"}]}).json["id"]
    theirs = rival.post(
        "/v1/batches", json=_spec(_file(rival, [_line("a", "thinkbatch-demo")]))
    ).json["id"]
    for asked in ("batch_" + uuid.uuid4().hex, "batch_" + uuid.UUID(native).hex, theirs):
        for answer in (client.get(f"/v1/batches/{asked}"),
                       client.post(f"/v1/batches/{asked}/cancel")):  # fmt: skip
            assert answer.status_code == 404
            error = answer.json["error"]
            assert error["code"] == "batch_not_found" and asked in error["message"], error


def test_a_replayed_batch_says_so(client: FlaskClient) -> None:
    spec = _spec(_file(client, [_line("a", "thinkbatch-demo")]))
    first = client.post("/v1/batches", json=spec, headers={"Idempotency-Key": "k-1"})
    again = client.post("/v1/batches", json=spec, headers={"Idempotency-Key": "k-1"})
    assert first.json["id"] == again.json["id"]
    assert first.headers["Idempotent-Replayed"] == "false"
    assert again.headers["Idempotent-Replayed"] == "true"


# --- requests that take no fields ------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"custom_ids": ["item-1"]} {{{', "invalid_json"),
        (b'{"custom_ids": ["item-1"]}', "unknown_field"),
        (b"not json at all", "invalid_json"),
        (b"[]", None),
        (b"null", None),
        (b" " * 2000 + b"{}", "request_entity_too_large"),
        # Not JSON's whitespace, though Python's strip() takes them for it: not an empty body.
        (b"\x0c", "invalid_json"),
        (b"\x0b\r\n", "invalid_json"),
        (b"\x1c", "invalid_json"),
    ],
)
def test_a_cancel_with_fields_cancels_nothing(
    client: FlaskClient, body: bytes, code: str | None
) -> None:
    job = client.post("/v1/jobs", json={"items": [{"prompt": "a"}, {"prompt": "b"}]}).json["id"]
    batch = client.post(
        "/v1/batches", json=_spec(_file(client, [_line("a", "thinkbatch-demo")]))
    ).json["id"]
    for route in (f"/v1/jobs/{job}/cancel", f"/v1/batches/{batch}/cancel"):
        answer = client.post(route, data=body, content_type="application/json")
        assert answer.status_code in (400, 413), (route, answer.status_code, answer.json)
        if code is not None:
            assert answer.json["error"]["code"] == code, answer.json
    assert client.get(f"/v1/jobs/{job}").json["status"] == "queued"
    assert client.get(f"/v1/batches/{batch}").json["status"] not in ("cancelling", "cancelled")


@pytest.mark.parametrize("body", [None, b"", b"{}", b" { } \n"])
def test_a_cancel_with_no_fields_cancels(client: FlaskClient, body: bytes | None) -> None:
    job = client.post("/v1/jobs", json={"items": [{"prompt": "a"}]}).json["id"]
    if body is None:
        answer = client.post(f"/v1/jobs/{job}/cancel")
    else:
        answer = client.post(f"/v1/jobs/{job}/cancel", data=body, content_type="application/json")
    assert answer.status_code == 200, answer.json
    assert answer.json["status"] in ("cancelling", "cancelled")


# --- empty query values ------------------------------------------------------------------------


def test_an_empty_query_value_is_refused_naming_the_parameter(client: FlaskClient) -> None:
    job = client.post("/v1/jobs", json={"items": [{"prompt": "a"}]}).json["id"]
    for path, name in (
        (f"/v1/jobs/{job}/items?status=", "status"),
        (f"/v1/jobs/{job}/results?status=", "status"),
        (f"/v1/jobs/{job}/items?after=", "after"),
        ("/v1/jobs?after=", "after"),
        ("/v1/batches?after=", "after"),
        ("/v1/files?order=", "order"),
        ("/v1/files?purpose=", "purpose"),
        ("/v1/files?after=", "after"),
        (f"/v1/jobs/{job}/items?limit=", "limit"),
        (f"/v1/jobs/{job}/items?include_thinking=", "include_thinking"),
    ):
        answer = client.get(path)
        assert answer.status_code == 400, (path, answer.status_code)
        assert answer.json["error"]["param"] == name, (path, answer.json)


def test_a_native_job_is_no_cursor_of_the_batches(client: FlaskClient) -> None:
    job = client.post("/v1/jobs", json={"items": [{"prompt": "a"}]}).json["id"]
    as_batch = "batch_" + uuid.UUID(job).hex
    assert client.get(f"/v1/batches/{as_batch}").status_code == 404
    answer = client.get(f"/v1/batches?after={as_batch}")
    assert answer.status_code == 400 and answer.json["error"]["param"] == "after"
    # A batch's own id is a cursor.
    batch = client.post(
        "/v1/batches", json=_spec(_file(client, [_line("a", "thinkbatch-demo")]))
    ).json["id"]
    assert client.get(f"/v1/batches?after={batch}").status_code == 200


def test_a_job_past_its_window_is_expired_by_the_read_that_finds_it(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    """The sweeper runs in workers; with no worker of its model alive (a set scaled to zero,
    whose scaler counts no lapsed job), a job past its window is expired by a status call or
    a batch's retrieval, not shown queued for as long as no worker starts."""
    client = _served(make_app, db, SERVED)
    native = client.post("/v1/jobs", json={"model": "big", "items": [{"prompt": "a"}]})
    assert native.status_code == 201, native.json
    batch = client.post("/v1/batches", json=_spec(_file(client, [_line("a", "lora-a")])))
    assert batch.status_code == 200, batch.json
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET expires_at = now() - interval '1 s'"))
    polled = client.get(f"/v1/jobs/{native.json['id']}")
    assert (polled.json["status"], polled.json["counts"]["expired"]) == ("expired", 1)
    retrieved = client.get(f"/v1/batches/{batch.json['id']}")
    assert retrieved.json["status"] == "expired", retrieved.json
    assert client.get(f"/v1/jobs/{native.json['id']}").json["status"] == "expired"  # read again
