"""The Files and Batches routes under careless and hostile input, through the app (no server):
uploads refused for what is actually wrong with them, never cut or altered; batch bodies and
input lines read by the same guarded reader as job bodies; and reads that never write."""

from __future__ import annotations

import io
import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

from thinkbatch import ledger
from thinkbatch.ledger import Done
from thinkbatch.openai import batches

HUGE_INT = b"9" * 5000  # past the 4,300 digits Python's int() takes from text


def line(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "thinkbatch-demo",
            "messages": [{"role": "user", "content": "hi"}],
            **body,
        },
    }


def jsonl(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def upload(client: FlaskClient, data: bytes, filename: str = "in.jsonl", **form: Any) -> Any:
    fields = {"purpose": "batch", **form, "file": (io.BytesIO(data), filename)}
    return client.post("/v1/files", data=fields, content_type="multipart/form-data")


def create(client: FlaskClient, file_id: str, **fields: Any) -> Any:
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        **fields,
    }
    return client.post("/v1/batches", json=body)


def count(db: sa.Engine, table: str) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())  # noqa: S608


def raw_form(parts: list[tuple[str, str | None, bytes]], *, close: bool = True) -> bytes:
    out = b""
    for name, filename, data in parts:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--b\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + data + b"\r\n"
    return out + (b"--b--\r\n" if close else b"")


def post_form(client: FlaskClient, body: bytes) -> Any:
    return client.post("/v1/files", data=body, content_type="multipart/form-data; boundary=b")


# --- uploads: refused for what is wrong, or kept as sent --------------------------------------


def test_a_long_filename_is_refused_not_cut(client: FlaskClient, db: sa.Engine) -> None:
    kept = upload(client, jsonl(line()), filename="f" * 250 + ".jsonl")
    assert kept.status_code == 200, kept.json
    assert kept.json["filename"] == "f" * 250 + ".jsonl"
    response = upload(client, jsonl(line()), filename="f" * 300 + ".jsonl")
    assert response.status_code == 400
    error = response.json["error"]
    assert (error["param"], error["code"]) == ("file", "filename_too_long")
    assert "306 characters" in error["message"]
    assert count(db, "files") == 1


def test_a_form_of_too_many_parts_says_so(client: FlaskClient, db: sa.Engine) -> None:
    parts = [("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(line()))]
    parts += [(f"x{n}", None, b"1") for n in range(20)]
    response = post_form(client, raw_form(parts))
    assert response.status_code == 400
    error = response.json["error"]
    assert error["code"] == "too_many_parts"
    assert "more than 16 parts" in error["message"]
    assert "MAX_REQUEST_BYTES" not in error["message"]
    assert count(db, "files") == 0


def test_a_cut_off_form_says_so(client: FlaskClient, db: sa.Engine) -> None:
    whole = raw_form([("purpose", None, b"batch"), ("file", "a.jsonl", jsonl(line()))])
    for cut in (whole[: len(whole) - 12], whole[: len(whole) // 2]):
        response = post_form(client, cut)
        assert response.status_code == 400, response.json
        error = response.json["error"]
        assert error["code"] == "invalid_multipart"
        assert "closing boundary" in error["message"]
    assert count(db, "files") == 0


@pytest.mark.parametrize(
    ("parts", "param", "words"),
    [
        ([("purpose", None, b"batch"), ("file", "a", b"{}"), ("colour", None, b"red")],
         "colour", "unknown form field"),
        ([("purpose", None, b"batch"), ("file", None, b"{}")], "file", "as a file part"),
        ([("purpose", None, b"batch")], "file", "exactly one file part (got 0)"),
        ([("purpose", None, b"\xff"), ("file", "a", b"{}")], "purpose", "not UTF-8"),
        ([("purpose", None, b"x" * 70_000), ("file", "a", b"{}")], "purpose", "longer than"),
    ],
)  # fmt: skip
def test_form_faults_are_named(
    client: FlaskClient, db: sa.Engine, parts: list[Any], param: str, words: str
) -> None:
    response = post_form(client, raw_form(parts))
    assert response.status_code == 400
    assert response.json["error"]["param"] == param
    assert words in response.json["error"]["message"]
    assert count(db, "files") == 0


def test_a_leading_byte_order_mark_is_ignored(client: FlaskClient, db: sa.Engine) -> None:
    data = b"\xef\xbb\xbf" + jsonl(line("a"), line("b"))
    stored = upload(client, data)
    assert stored.status_code == 200
    batch = create(client, stored.json["id"])
    assert batch.status_code == 200
    assert batch.json["status"] == "in_progress", batch.json["errors"]
    assert batch.json["request_counts"]["total"] == 2
    # The file itself is kept as sent, mark and all.
    content = client.get(f"/v1/files/{stored.json['id']}/content")
    assert content.data == data
    assert content.headers["Content-Length"] == str(len(data))


# --- numbers and limits: the same reader as job bodies ----------------------------------------


def test_a_very_long_integer_in_the_create_body_is_400(client: FlaskClient, db: sa.Engine) -> None:
    stored = upload(client, jsonl(line()))
    for body in (
        b'{"input_file_id":"' + stored.json["id"].encode() + b'","endpoint":"/v1/chat/'
        b'completions","completion_window":"24h","metadata":{"a":' + HUGE_INT + b"}}",
        b'{"input_file_id":' + HUGE_INT + b"}",
    ):
        response = client.post("/v1/batches", data=body, content_type="application/json")
        assert response.status_code == 400, response.data[:300]
        assert response.json["error"]["code"] == "integer_out_of_range"
    assert count(db, "jobs") == 0


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b'{"custom_id":"a","method":"POST","url":"/v1/chat/completions","body":{"model":'
         b'"thinkbatch-demo","messages":[{"role":"user","content":"hi"}],"seed":' + HUGE_INT
         + b"}}", "body.seed", "integer_out_of_range"),
        (json.dumps(line(messages=[{"role": "user", "content": "x"}] * 1025)).encode(),
         "body.messages", "too_many_messages"),
        (json.dumps(line(stop=[1] * 100_001)).encode(), None, "item_too_large"),
    ],
)  # fmt: skip
def test_a_bad_line_is_named_by_line_and_field(
    client: FlaskClient, db: sa.Engine, raw: bytes, param: str | None, code: str
) -> None:
    stored = upload(client, jsonl(line("ok")) + raw + b"\n")
    batch = create(client, stored.json["id"])
    assert batch.status_code == 200
    assert batch.json["status"] == "failed"
    [error] = batch.json["errors"]["data"]
    assert (error["line"], error["param"], error["code"]) == (2, param, code), error
    assert count(db, "items") == 0


def test_a_line_longer_than_any_item_is_refused_unread(
    client: FlaskClient, db: sa.Engine, make_app: Any
) -> None:
    from tests.helpers import TENANT
    from tests.helpers import keyed_client
    from tests.helpers import make_key

    small = keyed_client(make_app(max_item_chars=1000, max_prompt_chars=1000, max_item_values=100),
                         make_key(db, TENANT))  # fmt: skip
    limit = 6 * 1000 + 64 * 100
    data = jsonl(line("a")) + b"x" * (limit + 1) + b"\n" + jsonl(line("c"))
    stored = upload(small, data)
    batch = create(small, stored.json["id"])
    assert batch.json["status"] == "failed"
    [error] = batch.json["errors"]["data"]
    assert (error["line"], error["code"]) == (2, "line_too_long")
    assert f"longer than {limit} bytes" in error["message"]


# --- metadata kept as sent --------------------------------------------------------------------


def test_metadata_is_echoed_as_sent(client: FlaskClient, db: sa.Engine) -> None:
    stored = upload(client, jsonl(line()))
    shapes = {"absent": None, "empty": {}, "one": {"k": "v"}}
    for name, metadata in shapes.items():
        fields = {} if name == "absent" else {"metadata": metadata}
        made = create(client, stored.json["id"], **fields)
        assert made.status_code == 200
        assert made.json["metadata"] == metadata, name
        again = client.get(f"/v1/batches/{made.json['id']}")
        assert again.json["metadata"] == metadata, name


# --- reads never write ------------------------------------------------------------------------


def _finish(db: sa.Engine, job_id: uuid.UUID) -> None:
    """Run every item of a job to success through the ledger, as a worker would, without
    making the batch's files (the test decides when)."""
    owner = "test-worker"
    with db.begin() as conn:
        ledger.register_worker(conn, owner, hostname="h", pid=1, model="thinkbatch-demo")
        claimed = ledger.claim(conn, job_id, owner=owner, n=100, lease_s=60)
        ledger.complete(
            conn,
            owner,
            [Done(c.id, c.job_id, c.attempt, "t", f"answer {c.custom_id}", "stop", False, 3, 4, 1)
             for c in claimed],
        )  # fmt: skip
        ledger.finalize_jobs(conn, [job_id])


def _row_version(db: sa.Engine, job_id: uuid.UUID) -> tuple[str, int]:
    with db.connect() as conn:
        xmin, files = conn.execute(
            sa.text("SELECT xmin::text, (SELECT count(*) FROM files) FROM jobs WHERE id = :id"),
            {"id": job_id},
        ).one()
    return xmin, files


def test_reading_a_finished_batch_writes_nothing(client: FlaskClient, db: sa.Engine) -> None:
    stored = upload(client, jsonl(*(line(f"c{n}") for n in range(5))))
    made = create(client, stored.json["id"])
    job_id = uuid.UUID(made.json["id"].removeprefix("batch_"))
    _finish(db, job_id)
    before = _row_version(db, job_id)
    for _ in range(2):
        shown = client.get(f"/v1/batches/{made.json['id']}").json
        assert shown["status"] == "finalizing"
        assert shown["output_file_id"] is None and shown["completed_at"] is None
        assert shown["finalizing_at"] is not None
        listed = client.get("/v1/batches").json["data"]
        assert [b["status"] for b in listed] == ["finalizing"]
    assert _row_version(db, job_id) == before  # not even the job row was rewritten
    assert batches.make_due_files(db) == 1
    assert batches.make_due_files(db) == 0  # once
    shown = client.get(f"/v1/batches/{made.json['id']}").json
    assert shown["status"] == "completed" and shown["error_file_id"] is None
    after = _row_version(db, job_id)
    assert client.get(f"/v1/batches/{made.json['id']}").status_code == 200
    assert _row_version(db, job_id) == after
    output = client.get(f"/v1/files/{shown['output_file_id']}")
    content = client.get(f"/v1/files/{shown['output_file_id']}/content")
    assert content.headers["Content-Length"] == str(output.json["bytes"]) == str(len(content.data))
    assert len(content.data.splitlines()) == 5
