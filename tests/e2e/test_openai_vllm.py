"""Acceptance test 2 on the real engine: a chat batch through the official openai SDK, served by
a Celery worker with vLLM on the CPU (the tiny demo Qwen3)."""

from __future__ import annotations

import io
import json
import time

import httpx
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from tests.stacks import RunningStack

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack_url(vllm_stack: RunningStack) -> tuple[str, str]:
    return vllm_stack.base_url, vllm_stack.key()


def test_chat_batch_on_vllm(stack_url: tuple[str, str], request: pytest.FixtureRequest) -> None:
    url, key = stack_url
    sdk = OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, _strict_response_validation=True)
    request.addfinalizer(sdk.close)
    model = sdk.models.list().data[0].id
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": {
            "model": model, "max_completion_tokens": 48, "seed": i,
            "messages": [{"role": "user", "content": q}],
            "chat_template_kwargs": {"enable_thinking": think}}}
        for i, (q, think) in enumerate(
            [("What is 2+2?", True), ("Name a prime.", True), ("Say hi.", False),
             ("什么是连续批处理？", False)])
    ]  # fmt: skip
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = sdk.batches.create(
        input_file_id=file_id, endpoint=CHAT, completion_window="24h", metadata={"k": "v"}
    )
    deadline = time.monotonic() + 600
    # Until it ends: `finalizing` while its output files are made.
    while (batch := sdk.batches.retrieve(batch.id)).status in ("validating", "in_progress",
                                                              "finalizing"):  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert batch.status == "completed", batch
    counts = batch.request_counts
    assert counts is not None and (counts.total, counts.completed, counts.failed) == (4, 4, 0)
    assert batch.metadata == {"k": "v"}
    assert batch.created_at <= (batch.in_progress_at or 0) <= (batch.completed_at or 0)
    assert batch.output_file_id is not None
    out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).content.splitlines()]
    bodies = {x["custom_id"]: ChatCompletion.model_validate(x["response"]["body"]) for x in out}
    for cid in ("c0", "c1"):
        assert bodies[cid].choices[0].message.reasoning  # type: ignore[attr-defined]
    for cid in ("c2", "c3"):
        assert bodies[cid].choices[0].message.reasoning is None  # type: ignore[attr-defined]
    total = sum(b.usage.completion_tokens_details.reasoning_tokens for b in bodies.values())  # type: ignore[union-attr]
    assert batch.usage is not None
    assert batch.usage.output_tokens_details.reasoning_tokens == total
    items = httpx.get(f"{url}/v1/jobs/{batch.id}/items",
                      headers={"Authorization": f"Bearer {key}"}).json()["data"]  # fmt: skip
    assert {i["custom_id"]: i["answer"] for i in items} == {
        cid: b.choices[0].message.content for cid, b in bodies.items()
    }
