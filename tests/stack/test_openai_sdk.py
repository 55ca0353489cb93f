"""The official `openai` SDK drives thinkbatch unchanged (only `base_url` and `api_key` set), over
real HTTP: gunicorn and a Celery worker with the fake engine. The SDK validates every answer
against its own types (`_strict_response_validation`)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
import sqlalchemy as sa
from openai import OpenAI
from openai.types import Batch
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from tests.helpers import ROOT
from tests.helpers import Servers
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import api_key
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes: left out of make check

MODEL = "thinkbatch-demo"
CHAT = "/v1/chat/completions"
# One hour of a completion_window lasts 2 s here, so that expiry happens within a test.
HOUR_S = 2


class Env:
    def __init__(self, url: str, key: str, database_url: str):
        self.url, self.key = url, key
        self.db = sa.create_engine(database_url)
        self.sdk = OpenAI(
            base_url=url + "/v1", api_key=key, max_retries=0, _strict_response_validation=True
        )
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )


@pytest.fixture(scope="module")
def env(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    with running_stack(
        servers,
        tmp_path_factory.mktemp("openai"),
        "openai_sdk",
        THINKBATCH_ENGINE="fake",
        THINKBATCH_MODEL=MODEL,
        THINKBATCH_BATCH_HOUR_S=str(HOUR_S),
        THINKBATCH_MAX_MODEL_LEN="1024",
        **FAST_RECOVERY_ENV,
    ) as running:
        env = Env(running.base_url, running.key(), running.database_url)
        yield env
        env.sdk.close()
        env.http.close()
        env.db.dispose()


def chat_line(custom_id: str, text: str, *, think: bool | None = None, **body: Any) -> dict:
    payload: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_completion_tokens": 200,
        **body,
    }
    if think is not None:
        payload["chat_template_kwargs"] = {"enable_thinking": think}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": payload}


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


def upload(env: Env, data: bytes, name: str = "in.jsonl") -> str:
    return env.sdk.files.create(file=(name, io.BytesIO(data)), purpose="batch").id


def wait(env: Env, batch_id: str, until: tuple[str, ...], timeout: float = 60) -> Batch:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = env.sdk.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        time.sleep(0.1)
    raise AssertionError(f"{batch_id} never reached {until}: {batch}")


def lines_of(env: Env, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(x) for x in env.sdk.files.content(file_id).content.splitlines()]


# 1 ---------------------------------------------------------------------------------------------
def test_upload_round_trips_the_bytes(env: Env) -> None:
    data = jsonl([chat_line(f"c{i}", "héllo " * 50) for i in range(2000)])  # ~1.4 MB: 2 chunks
    f = env.sdk.files.create(file=("big.jsonl", io.BytesIO(data)), purpose="batch")
    assert f.bytes == len(data) and f.filename == "big.jsonl" and f.status == "processed"
    assert env.sdk.files.content(f.id).content == data
    assert env.sdk.files.retrieve(f.id).bytes == len(data)


# 2 ---------------------------------------------------------------------------------------------
def test_chat_batch_completes_with_openai_shaped_output(env: Env) -> None:
    lines = [
        chat_line("think-1", "What is 2+2?", think=True),
        chat_line("think-2", "Name a prime.", think=True),
        chat_line("plain-1", "Say hi.", think=False),
        {**chat_line("plain-2", "x", think=False), "body": {
            "model": MODEL, "max_tokens": 100, "temperature": 0.5, "top_p": 0.9, "seed": 7,
            "chat_template_kwargs": {"enable_thinking": False},
            "messages": [{"role": "developer", "content": "Be terse."},
                         {"role": "user", "content": [{"type": "text", "text": "Why?"}]}]}},
    ]  # fmt: skip
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)),
        endpoint=CHAT,
        completion_window="24h",
        metadata={"run": "acceptance-2"},
    )
    assert batch.status == "in_progress" and batch.id.startswith("batch_")
    done = wait(env, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    counts = done.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (4, 4, 0)
    assert done.metadata == {"run": "acceptance-2"}
    assert done.in_progress_at is not None and done.completed_at is not None
    assert done.created_at <= done.in_progress_at <= done.completed_at
    assert done.error_file_id is None and done.model == MODEL
    out = lines_of(env, done.output_file_id)
    assert [x["custom_id"] for x in out] == ["think-1", "think-2", "plain-1", "plain-2"]
    assert env.sdk.files.retrieve(done.output_file_id).bytes == len(  # type: ignore[arg-type]
        env.sdk.files.content(done.output_file_id).content  # type: ignore[arg-type]
    )
    bodies = {x["custom_id"]: ChatCompletion.model_validate(x["response"]["body"]) for x in out}
    for line in out:
        assert line["response"]["status_code"] == 200 and line["error"] is None
        assert line["id"].startswith("batch_req_")
    for cid in ("think-1", "think-2"):
        message = bodies[cid].choices[0].message
        assert message.reasoning and message.reasoning_content == message.reasoning  # type: ignore[attr-defined]
    for cid in ("plain-1", "plain-2"):
        assert bodies[cid].choices[0].message.reasoning is None  # type: ignore[attr-defined]
    reasoning = sum(
        b.usage.completion_tokens_details.reasoning_tokens  # type: ignore[union-attr]
        for b in bodies.values()
    )
    assert done.usage is not None
    assert done.usage.output_tokens_details.reasoning_tokens == reasoning > 0
    # Both APIs see the same work: the job's items hold the same answers.
    items = env.http.get(f"/v1/jobs/{batch.id}/items").json()["data"]
    assert {i["custom_id"]: i["answer"] for i in items} == {
        cid: b.choices[0].message.content for cid, b in bodies.items()
    }


# 3 ---------------------------------------------------------------------------------------------
def test_completions_batch(env: Env) -> None:
    lines = [
        {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 50, "logprobs": i}}
        for i in range(3)
    ]  # fmt: skip
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)),
        endpoint="/v1/completions",
        completion_window="24h",
    )
    done = wait(env, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    for line in lines_of(env, done.output_file_id):
        body = Completion.model_validate(line["response"]["body"], strict=True)
        assert body.object == "text_completion" and body.choices[0].text
        logprobs = body.choices[0].logprobs  # the legacy shape, every list as long
        assert logprobs is not None and logprobs.tokens is not None
        assert (
            len(logprobs.tokens)
            == len(logprobs.text_offset or ())
            == len(logprobs.top_logprobs or ())
        )


def test_output_files_expire_as_the_batch_asked(env: Env) -> None:
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl([chat_line("x", "hello")])),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done = wait(env, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.output_file_id
    output = env.sdk.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output"
    assert output.expires_at == output.created_at + 7200
    with pytest.raises(openai.BadRequestError):  # outside OpenAI's bounds (1 h to 30 days)
        env.sdk.batches.create(
            input_file_id=upload(env, jsonl([chat_line("y", "hi")])),
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 60},
        )


# 4 ---------------------------------------------------------------------------------------------
def test_bad_lines_fail_the_batch_and_store_nothing(env: Env) -> None:
    lines = [
        chat_line("ok-1", "fine"),
        b'{"custom_id": "broken", ',
        {**chat_line("extra", "x"), "priority": 1},  # a line holds custom_id, method, url, body
        {**chat_line("wrong-url", "x"), "url": "/v1/completions"},
        chat_line("ok-1", "duplicate id"),
        {**chat_line("model", "x"), "body": {**chat_line("model", "x")["body"], "model": "gpt-9"}},
    ]
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)), endpoint=CHAT, completion_window="24h"
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.errors is not None and batch.errors.data is not None
    got = {(e.line, e.param) for e in batch.errors.data}
    assert got == {
        (2, None),
        (3, "priority"),
        (4, "url"),
        (5, "custom_id"),
        (6, "body.model"),
    }, batch.errors
    codes = {e.line: e.code for e in batch.errors.data}
    assert codes[2] == "invalid_json" and codes[5] == "duplicate_custom_id"
    with env.db.connect() as conn:
        job = batch.id.removeprefix("batch_")
        stored = conn.execute(sa.text("SELECT count(*) FROM items WHERE job_id = :j"), {"j": job})
        assert stored.scalar() == 0


# 4b --------------------------------------------------------------------------------------------
TOOL = {"type": "function", "function": {"name": "f", "description": "Call me.",
        "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_the_request_vocabulary_and_bad_bodies(env: Env) -> None:
    json_format = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA,
                                                          "strict": True}}  # fmt: skip
    lines = [
        chat_line("n2", "Two answers.", think=False, n=2, seed=1),
        chat_line("lp", "Log probs.", think=False, logprobs=True, top_logprobs=2),
        chat_line("json", "JSON please.", think=False, response_format=json_format),
        chat_line("tool", "[[tool]] Call f.", think=True, tools=[TOOL], tool_choice="auto",
                  parallel_tool_calls=True, service_tier="auto", user="u", store=False,
                  metadata={"k": "v"}),
        chat_line("bad-temp", "x", temperature=9),
        chat_line("bad-field", "x", colour="red"),
        chat_line("bad-choice", "x", tools=[TOOL], tool_choice={"type": "function",
                                                                "function": {}}),
        {**chat_line("bad-body", "x"), "body": "not a request"},
    ]  # fmt: skip
    refused = {
        "bad-temp": ("temperature", "invalid_value"),
        "bad-field": ("colour", "unknown_parameter"),
        "bad-choice": ("tool_choice.function.name", "missing_required_parameter"),
        "bad-body": (None, "invalid_value"),
    }
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)), endpoint=CHAT, completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.errors is None
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.failed) == (8, 4)
    done = wait(env, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    out = {x["custom_id"]: x for x in lines_of(env, done.output_file_id)}
    errors = {x["custom_id"]: x for x in lines_of(env, done.error_file_id)}
    assert set(out) | set(errors) == {line["custom_id"] for line in lines}
    bodies = {
        cid: ChatCompletion.model_validate(x["response"]["body"], strict=True)
        for cid, x in out.items()
    }
    for body in bodies.values():
        assert [c.index for c in body.choices] == list(range(len(body.choices)))
        assert body.service_tier == "default"
    two = bodies["n2"].choices
    assert len(two) == 2 and two[0].message.content != two[1].message.content
    logprobs = bodies["lp"].choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert all(len(t.top_logprobs) == 2 for t in logprobs.content)
    tool = bodies["tool"].choices[0]
    assert tool.finish_reason == "tool_calls" and tool.message.tool_calls is not None
    [call] = tool.message.tool_calls
    assert call.type == "function" and call.function.name == "f"  # type: ignore[union-attr]
    assert isinstance(json.loads(call.function.arguments), dict)  # type: ignore[union-attr]
    assert tool.message.reasoning  # type: ignore[attr-defined]
    assert isinstance(json.loads(bodies["json"].choices[0].message.content or "")["a"], int)
    assert set(errors) == set(refused)
    for cid, (param, code) in refused.items():
        line = errors[cid]
        assert line["error"] is None and line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 400 and response["request_id"].startswith("req_")
        error = ErrorObject.model_validate(response["body"]["error"], strict=True)
        assert (error.param, error.code, error.type) == (param, code, "invalid_request_error")
    # The native view of the same job: the refused lines failed, with their errors.
    items = env.http.get(f"/v1/jobs/{batch.id}/items", params={"status": "failed"}).json()
    codes = {i["custom_id"]: i["error"]["code"] for i in items["data"]}
    assert {cid: codes[cid] for cid in refused} == {cid: c for cid, (_, c) in refused.items()}


# 5 ---------------------------------------------------------------------------------------------
def test_bad_endpoint_and_unknown_file(env: Env) -> None:
    file_id = upload(env, jsonl([chat_line("a", "x")]))
    with pytest.raises(openai.BadRequestError) as bad:
        env.sdk.batches.create(
            input_file_id=file_id,
            endpoint="/v1/embeddings",
            completion_window="24h",  # type: ignore[arg-type]
        )
    assert bad.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        env.sdk.batches.create(
            input_file_id="file-" + "0" * 32, endpoint=CHAT, completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        env.sdk.files.retrieve("file-nope")


# 6 ---------------------------------------------------------------------------------------------
def test_over_long_prompt_fails_its_line_only(env: Env) -> None:
    lines = [chat_line("fine", "short"), chat_line("long", "token " * 400)]
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)), endpoint=CHAT, completion_window="24h"
    )
    done = wait(env, batch.id, ("completed", "failed"))
    assert done.status == "completed"
    assert done.request_counts is not None and done.request_counts.failed == 1
    errors = lines_of(env, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["long"]
    response = errors[0]["response"]
    assert response["status_code"] == 400
    assert response["body"]["error"]["code"] == "context_length_exceeded"
    assert [x["custom_id"] for x in lines_of(env, done.output_file_id)] == ["fine"]


# 7 ---------------------------------------------------------------------------------------------
def test_cancel_mid_run(env: Env) -> None:
    lines = [chat_line("hang", "[[hang]]")] + [chat_line(f"q{i}", "x") for i in range(3)]
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)), endpoint=CHAT, completion_window="24h"
    )
    deadline = time.monotonic() + 30
    while env.http.get(f"/v1/jobs/{batch.id}").json()["counts"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelling = env.sdk.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
    done = wait(env, batch.id, ("cancelled",))
    assert done.cancelled_at is not None and done.cancelling_at is not None
    errors = {e["custom_id"]: e for e in lines_of(env, done.error_file_id)}
    assert errors["hang"]["response"] is None
    assert errors["hang"]["error"]["code"] == "batch_cancelled"
    # A second cancel is a 400, which the SDK does not retry (it retries 409s).
    sent: list[str] = []
    counting = OpenAI(
        base_url=env.url + "/v1",
        api_key=env.key,
        max_retries=2,
        http_client=httpx2.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]}),
    )
    with counting, pytest.raises(openai.BadRequestError):
        counting.batches.cancel(batch.id)
    assert len(sent) == 1


# 8 ---------------------------------------------------------------------------------------------
def test_window_passes_and_the_batch_expires(env: Env) -> None:
    lines = [chat_line("hang", "[[hang]]"), chat_line("later", "x")]
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl(lines)), endpoint=CHAT, completion_window="1h"
    )
    done = wait(env, batch.id, ("expired", "completed"), timeout=60)
    assert done.status == "expired" and done.expired_at is not None
    errors = lines_of(env, done.error_file_id)
    assert "hang" in {e["custom_id"] for e in errors}
    for e in errors:
        assert e["response"] is None and e["error"]["code"] == "batch_expired"


# 9 ---------------------------------------------------------------------------------------------
def test_pagination_of_batches_and_files(env: Env) -> None:
    made = []
    for i in range(7):
        file_id = upload(env, jsonl([chat_line("a", "x")]), name=f"page-{i}.jsonl")
        made.append(
            env.sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h").id
        )
    first = env.sdk.batches.list(limit=3)
    assert [b.id for b in first.data] == made[::-1][:3]
    assert first.has_more and first.last_id == made[-3] and first.first_id == made[-1]
    seen = [b.id for b in env.sdk.batches.list(limit=3)]  # auto-paging follows `after`
    assert seen[:7] == made[::-1]
    files = env.sdk.files.list(limit=3, order="asc")
    assert len(files.data) == 3 and files.has_more
    everything = [f.id for f in env.sdk.files.list(limit=3, order="desc")]
    assert len(everything) == len(set(everything)) >= 7
    last = env.sdk.files.list(limit=1000, purpose="batch")
    assert not last.has_more and last.last_id == last.data[-1].id


# 10 --------------------------------------------------------------------------------------------
def test_deleted_file_is_gone(env: Env) -> None:
    file_id = upload(env, jsonl([chat_line("a", "x")]))
    deleted = env.sdk.files.delete(file_id)
    assert deleted.deleted and deleted.id == file_id
    with pytest.raises(openai.NotFoundError):
        env.sdk.files.retrieve(file_id)
    with pytest.raises(openai.NotFoundError):
        env.sdk.files.content(file_id)


# 11 --------------------------------------------------------------------------------------------
def test_idempotent_create(env: Env) -> None:
    file_id = upload(env, jsonl([chat_line("a", "x")]))
    headers = {"Idempotency-Key": "create-once-123"}
    kwargs: dict[str, Any] = {"input_file_id": file_id, "endpoint": CHAT,
                              "completion_window": "24h", "extra_headers": headers}  # fmt: skip
    one = env.sdk.batches.create(**kwargs)
    two = env.sdk.batches.create(**kwargs)
    assert one.id == two.id
    # The same key with any other field changed is refused, never quietly the first batch.
    for change in ({"completion_window": "1h"}, {"metadata": {"k": "v"}}):
        with pytest.raises(openai.BadRequestError) as refused:
            env.sdk.batches.create(**{**kwargs, **change})
        assert refused.value.code == "idempotency_key_reused", change
    with env.db.connect() as conn:
        count = conn.execute(
            sa.text("SELECT count(*) FROM jobs WHERE idempotency_key = 'create-once-123'")
        )
        assert count.scalar() == 1


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("metadata", '{"k\\u0000": "v"}'),
        ("metadata", '{"k": "v\\u0000"}'),
        ("metadata", '{"k": "\\ud800"}'),
        ("completion_window", '"24h\\u0000"'),
        ("input_file_id", '"file-\\udfff"'),
    ],
)
def test_batch_create_refuses_what_postgres_cannot_store(env: Env, field: str, text: str) -> None:
    file_id = upload(env, jsonl([chat_line("a", "x")]))
    body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
    body.pop(field, None)  # the field under test is written raw, with its escape
    raw = json.dumps(body)[:-1] + f', "{field}": {text}}}'
    response = env.http.post(
        "/v1/batches", content=raw.encode(), headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(field), response.text


def test_models_and_job_ids_in_both_forms(env: Env) -> None:
    models = env.sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    batch = env.sdk.batches.create(
        input_file_id=upload(env, jsonl([chat_line("a", "x")])),
        endpoint=CHAT,
        completion_window="24h",
    )
    plain = batch.id.removeprefix("batch_")
    assert env.http.get(f"/v1/jobs/{batch.id}").json()["id"].replace("-", "") == plain


def test_another_tenant_sees_no_file_or_batch(env: Env, request: pytest.FixtureRequest) -> None:
    file_id = upload(env, jsonl([chat_line("a", "x")]))
    batch = env.sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    rival = OpenAI(
        base_url=env.url + "/v1",
        api_key=api_key(env.db.url.render_as_string(hide_password=False), "rival"),
        max_retries=0,
    )
    request.addfinalizer(rival.close)
    for call in (
        lambda: rival.files.retrieve(file_id),
        lambda: rival.files.content(file_id),
        lambda: rival.batches.retrieve(batch.id),
        lambda: rival.batches.cancel(batch.id),
        lambda: rival.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()


# 12 --------------------------------------------------------------------------------------------
def cli(env: Env, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "thinkbatch.cli", *args],
        cwd=ROOT,
        env={**os.environ, "THINKBATCH_URL": env.url, "THINKBATCH_API_KEY": env.key},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_end_to_end(env: Env, tmp_path: Path) -> None:
    good = tmp_path / "good.jsonl"
    good.write_bytes(jsonl([chat_line(f"g{i}", f"question {i}", think=True) for i in range(3)]))
    run = cli(env, "submit", str(good), "--wait")
    assert run.returncode == 0, run.stderr
    batch_id = run.stdout.split()[0]
    assert batch_id.startswith("batch_")
    assert "completed 3/3 done, 0 failed" in run.stdout
    assert "reasoning)" in run.stdout
    # The job's thinking statistics close the summary (3 items thought, none truncated).
    assert re.search(
        r"thinking: \d+% of completion tokens; 3 items thought, tokens p50 \d+", run.stdout
    )
    assert "truncated by budget 0, by max_tokens 0" in run.stdout, run.stdout

    out = tmp_path / "out.jsonl"
    got = cli(env, "results", batch_id, "-o", str(out), "--format", "openai")
    assert got.returncode == 0 and "3 lines written" in got.stdout
    for line in out.read_text().splitlines():
        assert ChatCompletion.model_validate(json.loads(line)["response"]["body"])

    mixed = tmp_path / "native.jsonl"  # native item lines go through /v1/jobs
    mixed.write_text(
        json.dumps({"custom_id": "ok", "prompt": "hello"}) + "\n"
        + json.dumps({"custom_id": "long", "prompt": "token " * 400}) + "\n"
    )  # fmt: skip
    run = cli(env, "submit", str(mixed), "--wait")
    assert run.returncode == 3, run.stdout + run.stderr
    assert "completed 2/2 done, 1 failed" in run.stdout
    job_id = run.stdout.split()[0]
    native = tmp_path / "native-out.jsonl"
    assert cli(env, "results", job_id, "-o", str(native)).returncode == 0
    assert [json.loads(x)["status"] for x in native.read_text().splitlines()] == [
        "succeeded",
        "failed",
    ]
    status = cli(env, "status", job_id)
    assert status.returncode == 3 and "1 failed" in status.stdout
    assert job_id in cli(env, "list").stdout

    missing = cli(env, "status", "batch_" + "0" * 32)
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "404" in missing.stderr
    assert cli(env, "submit", str(tmp_path / "absent.jsonl")).returncode == 1
    assert cli(env, "no-such-command").returncode == 2

    hang = tmp_path / "hang.jsonl"
    hang.write_bytes(jsonl([chat_line("h", "[[hang]]")]))
    batch_id = cli(env, "submit", str(hang)).stdout.split()[0]
    assert cli(env, "cancel", batch_id).returncode == 0
    watched = cli(env, "status", batch_id, "--watch")
    assert watched.returncode == 4 and "cancelled" in watched.stdout
