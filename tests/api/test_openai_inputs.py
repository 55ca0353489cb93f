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
from thinkbatch.settings import ESCAPED_CHAR_BYTES

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
        # Not a blank line: JSON's whitespace holds no form feed (Python's strip() takes it).
        (b"\x0c", None, "invalid_json"),
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
    limit = ESCAPED_CHAR_BYTES * 1000 + 64 * 100
    data = jsonl(line("a")) + b"x" * (limit + 1) + b"\n" + jsonl(line("c"))
    stored = upload(small, data)
    batch = create(small, stored.json["id"])
    assert batch.json["status"] == "failed"
    [error] = batch.json["errors"]["data"]
    assert (error["line"], error["code"]) == (2, "line_too_long")
    assert f"longer than {limit} bytes" in error["message"]


def test_a_line_of_escaped_pairs_within_the_item_limits_is_read(
    client: FlaskClient, db: sa.Engine, make_app: Any
) -> None:
    # A character outside the BMP is one character of MAX_ITEM_CHARS but twelve bytes as an
    # escaped surrogate pair (json.dumps' default): its line is longer than six bytes a
    # character and 64 a value allow, and is still an item within the limits.
    from tests.helpers import TENANT
    from tests.helpers import keyed_client
    from tests.helpers import make_key

    small = keyed_client(make_app(max_item_chars=1000, max_prompt_chars=1000, max_item_values=20),
                         make_key(db, TENANT))  # fmt: skip
    data = jsonl(line("a", messages=[{"role": "user", "content": "\U0001f600" * 900}]))
    assert len(data) > 6 * 1000 + 64 * 20
    batch = create(small, upload(small, data).json["id"])
    assert batch.status_code == 200, batch.json
    assert batch.json["status"] != "failed", batch.json["errors"]
    assert count(db, "items") == 1


# --- a bad request body fails its line alone -------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# Each: a line whose body is at fault, the param its error names, and the code.
BAD_BODIES: list[tuple[dict[str, Any], str | None, str]] = [
    (line("temp", temperature=9), "temperature", "invalid_value"),
    (line("unknown", colour="red"), "colour", "unknown_parameter"),
    (line("top", top_logprobs=2), "top_logprobs", "invalid_value"),
    (line("choice", tool_choice="auto"), "tool_choice", "invalid_value"),
    (line("parallel", parallel_tool_calls=False), "parallel_tool_calls", "invalid_value"),
    (line("both", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
     "structured_outputs", "invalid_value"),
    (line("schema", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}),
     "response_format.json_schema.schema", "invalid_schema"),
    (line("refloop", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#"}}}),
     "response_format.json_schema.schema", "invalid_schema"),
    (line("remote", response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "http://169.254.169.254/latest"}}}),
     "response_format.json_schema.schema", "invalid_schema"),
    (line("bias", logit_bias={"1": 5, "01": -5}), "logit_bias.01", "invalid_value"),
    (line("cap", max_completion_tokens=10**6), "max_completion_tokens", "max_tokens_too_large"),
    (line("many", n=99), "n", "invalid_value"),
    (line("lp", logprobs=True, top_logprobs=20, max_tokens=30000, n=4),
     "logprobs", "logprobs_too_large"),
    (line("long", messages=[{"role": "user", "content": "x" * 5000}]),
     "messages", "prompt_too_large"),
    (line("role", messages=[{"role": "robot", "content": "x"}]), "messages[0].role",
     "invalid_value"),
    ({**line("notobj"), "body": "hello"}, None, "invalid_value"),
    ({**line("nomodel"), "body": {"messages": [{"role": "user", "content": "x"}]}}, "model",
     "missing_required_parameter"),
]  # fmt: skip


def _items(db: sa.Engine, job_id: uuid.UUID) -> dict[str, Any]:
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT custom_id, status, messages, prompt, params, error_code, error_param, "
                "error_message, finished_at FROM items WHERE job_id = :j ORDER BY seq"
            ),
            {"j": job_id},
        )
        return {r.custom_id: r for r in rows}


def _counts(db: sa.Engine, job_id: uuid.UUID) -> tuple[Any, ...]:
    with db.connect() as conn:
        return tuple(
            conn.execute(
                sa.text(
                    "SELECT status, total, unfinished, failed, succeeded, hinted_at IS NOT NULL "
                    "FROM jobs WHERE id = :j"
                ),
                {"j": job_id},
            ).one()
        )


def _job_id(batch: Any) -> uuid.UUID:
    return uuid.UUID(batch.json["id"].removeprefix("batch_"))


def test_bad_bodies_fail_their_lines_and_the_rest_runs(
    client: FlaskClient, db: sa.Engine, make_app: Any
) -> None:
    from tests.helpers import TENANT
    from tests.helpers import keyed_client
    from tests.helpers import make_key

    small = keyed_client(make_app(max_prompt_chars=4000), make_key(db, TENANT))
    bodies = [line("ok-1"), *(b[0] for b in BAD_BODIES), line("ok-2", n=2, logprobs=True)]
    batch = create(small, upload(small, jsonl(*bodies)).json["id"])
    assert batch.status_code == 200, batch.json
    assert batch.json["status"] == "in_progress", batch.json["errors"]
    assert batch.json["errors"] is None
    counts = batch.json["request_counts"]
    bad = len(BAD_BODIES)
    assert counts == {"total": bad + 2, "completed": 0, "failed": bad}
    job_id = _job_id(batch)
    assert _counts(db, job_id) == ("queued", bad + 2, 2, bad, 0, True)
    stored = _items(db, job_id)
    for body, param, code in BAD_BODIES:
        got = stored[body["custom_id"]]
        assert (got.status, got.error_param, got.error_code) == ("failed", param, code), got
        assert got.messages is None and got.prompt is None and got.params is None
        assert got.finished_at is not None
        assert "body." not in got.error_message and "items[" not in got.error_message
    assert stored["ok-2"].status == "pending"
    assert stored["ok-2"].params == {"n": 2, "logprobs": True}
    # A worker claims only pending items: the refused ones never reach it.
    _finish(db, job_id)
    assert _counts(db, job_id)[:5] == ("completed", bad + 2, 0, bad, 2)
    assert batches.make_due_files(db) == 1
    shown = small.get(f"/v1/batches/{batch.json['id']}").json
    assert shown["status"] == "completed"
    assert shown["request_counts"] == {"total": bad + 2, "completed": 2, "failed": bad}
    errors = small.get(f"/v1/files/{shown['error_file_id']}/content").data.splitlines()
    by_id = {e["custom_id"]: e for e in map(json.loads, errors)}
    assert list(by_id) == [b[0]["custom_id"] for b in BAD_BODIES]  # in the file's order
    for body, param, code in BAD_BODIES:
        got = by_id[body["custom_id"]]
        assert got["error"] is None and got["id"].startswith("batch_req_")
        response = got["response"]
        assert response["status_code"] == 400 and response["request_id"].startswith("req_")
        error = response["body"]["error"]
        assert error["type"] == "invalid_request_error"
        assert (error["param"], error["code"]) == (param, code), error
        assert error["message"].startswith(f"{param}: " if param else "must be"), error
    output = small.get(f"/v1/files/{shown['output_file_id']}/content").data.splitlines()
    assert [json.loads(x)["custom_id"] for x in output] == ["ok-1", "ok-2"]


def test_a_batch_whose_every_line_is_refused_completes_at_once(
    client: FlaskClient, db: sa.Engine, make_app: Any
) -> None:
    from tests.helpers import TENANT
    from tests.helpers import keyed_client
    from tests.helpers import make_key

    # Refused lines never run, so they take none of the tenant's quota of unfinished items.
    small = keyed_client(make_app(tenant_max_unfinished_items=1), make_key(db, TENANT))
    bodies = [line(f"bad-{n}", temperature=9) for n in range(5)]
    batch = create(small, upload(small, jsonl(*bodies)).json["id"])
    assert batch.status_code == 200, batch.json
    assert batch.json["status"] == "completed", batch.json
    assert batch.json["request_counts"] == {"total": 5, "completed": 0, "failed": 5}
    assert batch.json["completed_at"] is not None and batch.json["error_file_id"]
    assert _counts(db, _job_id(batch)) == ("completed", 5, 0, 5, 0, False)  # never hinted
    errors = small.get(f"/v1/files/{batch.json['error_file_id']}/content").data.splitlines()
    assert [json.loads(e)["custom_id"] for e in errors] == [f"bad-{n}" for n in range(5)]
    assert small.get(f"/v1/files/{batch.json['output_file_id']}/content").data == b""
    # Within the quota, the next batch is taken.
    more = create(small, upload(small, jsonl(line("ok"))).json["id"])
    assert more.json["status"] == "in_progress", more.json


def test_a_fault_of_the_file_still_fails_the_batch_whole(
    client: FlaskClient, db: sa.Engine
) -> None:
    bodies = [line("a"), line("b", temperature=9), line("b"), line("c", colour="x")]
    batch = create(client, upload(client, jsonl(*bodies)).json["id"])
    assert batch.json["status"] == "failed"
    # Only the file's faults are listed (a refused line would have been its request's failure).
    [error] = batch.json["errors"]["data"]
    assert (error["line"], error["param"], error["code"]) == (3, "custom_id", "duplicate_custom_id")
    assert count(db, "items") == 0


def test_a_refused_line_keeps_its_custom_id(client: FlaskClient, db: sa.Engine) -> None:
    bodies = [line("a", temperature=9), line("a")]
    batch = create(client, upload(client, jsonl(*bodies)).json["id"])
    assert batch.json["status"] == "failed"
    [error] = batch.json["errors"]["data"]
    assert (error["line"], error["code"]) == (2, "duplicate_custom_id")


def test_completions_lines_refuse_tools(client: FlaskClient, db: sa.Engine) -> None:
    prompt = {"custom_id": "p", "method": "POST", "url": "/v1/completions",
              "body": {"model": "thinkbatch-demo", "prompt": "x", "tools": [TOOL]}}  # fmt: skip
    ok = {**prompt, "custom_id": "q", "body": {**prompt["body"], "tools": None, "logprobs": 2}}
    stored = upload(client, jsonl(prompt, ok))
    batch = create(client, stored.json["id"], endpoint="/v1/completions")
    assert batch.json["status"] == "in_progress", batch.json
    items = _items(db, _job_id(batch))
    assert (items["p"].status, items["p"].error_param) == ("failed", "tools")
    assert items["q"].params == {"logprobs": True, "top_logprobs": 2}


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
        ledger.register_worker(
            conn, owner, hostname="h", pid=1, model="thinkbatch-demo", dead_after_s=60
        )
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


def test_vllms_ignore_eos_and_an_echoed_refusal_are_accepted(
    client: FlaskClient, db: sa.Engine
) -> None:
    """A line takes what a job takes (`ignore_eos`), and an assistant message echoed back
    from an earlier completion carries OpenAI's `refusal` field."""
    turns = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello", "refusal": None},
        {"role": "user", "content": "again"},
    ]
    batch = create(
        client, upload(client, jsonl(line("eos", ignore_eos=True, messages=turns))).json["id"]
    )
    assert batch.status_code == 200, batch.json
    assert batch.json["request_counts"]["failed"] == 0, batch.json
    stored = _items(db, _job_id(batch))["eos"]
    assert stored.status == "pending"
    assert stored.params == {"ignore_eos": True}
    assert [m["content"] for m in stored.messages] == ["hi", "hello", "again"]
