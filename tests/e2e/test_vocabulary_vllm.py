"""The request vocabulary on vLLM's CPU engine with the demo model, through the official openai
SDK (strict response validation) and the one end-to-end stack: structured answers after free
thinking, a thinking budget with a schema, several choices, logprobs and a named tool.

The tiny model cannot write JSON on its own (the controls show it): constrained decoding is what
makes every schema item parse, with its thinking kept apart.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion

from tests.stacks import RunningStack

pytestmark = pytest.mark.e2e
CHAT = "/v1/chat/completions"
# Enums only: the model must choose, and cannot wander inside a free string until max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "verdict": {"enum": ["yes", "no", "maybe"]},
        "score": {"enum": [1, 2, 3, 4, 5]},
        "sure": {"type": "boolean"},
    },
    "required": ["verdict", "score", "sure"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "grade", "schema": SCHEMA, "strict": True}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
QUESTIONS = [
    "Is the sky blue?", "What is 2+2?", "Name a prime number.", "Is water wet?",
    "What is continuous batching?", "Can a cat fly?",
]  # fmt: skip
N_SCHEMA, N_CONTROL = 100, 20


def _line(custom_id: str, model: str, question: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {
        "model": model, "max_completion_tokens": 96, "messages": [
            {"role": "user", "content": question}], **body}}  # fmt: skip


@pytest.fixture(scope="module")
def outputs(vllm_stack: RunningStack) -> Iterator[dict[str, ChatCompletion]]:
    """One batch with every case, run once for the module's tests: each line's completion."""
    sdk = OpenAI(base_url=vllm_stack.base_url + "/v1", api_key=vllm_stack.key(), max_retries=0,
                 _strict_response_validation=True)  # fmt: skip
    model = sdk.models.list().data[0].id
    lines = [
        _line(f"schema-{k}", model, QUESTIONS[k % len(QUESTIONS)], seed=k, response_format=FORMAT)
        for k in range(N_SCHEMA)
    ]
    lines += [
        _line(f"control-{k}", model, QUESTIONS[k % len(QUESTIONS)], seed=k)
        for k in range(N_CONTROL)
    ]
    lines += [
        # The stack's low effort is a budget of 8 thinking tokens (tests/e2e/conftest.py).
        _line("budget", model, QUESTIONS[4], seed=1, response_format=FORMAT,
              reasoning_effort="low"),
        _line("n3", model, QUESTIONS[0], seed=3, n=3, temperature=1.0),
        _line("logprobs", model, QUESTIONS[1], seed=4, logprobs=True, top_logprobs=3),
        _line("tool", model, "What is the weather in Paris?", seed=5, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        # Low effort leaves room for the call after a short thinking.
        _line("one-call", model, "Weather in Paris, Rome and Oslo?", seed=6, tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, reasoning_effort="low"),
    ]  # fmt: skip
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    file_id = sdk.files.create(file=("vocab.jsonl", io.BytesIO(data)), purpose="batch").id
    batch = sdk.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 600
    while (batch := sdk.batches.retrieve(batch.id)).status in ("validating", "in_progress",
                                                              "finalizing"):  # fmt: skip
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    content = sdk.files.content(batch.output_file_id).content
    got = {}
    for raw in content.splitlines():
        line = json.loads(raw)
        assert line["response"]["status_code"] == 200, line
        got[line["custom_id"]] = ChatCompletion.model_validate(line["response"]["body"])
    assert len(got) == len(lines), batch.request_counts
    sdk.close()
    yield got


def _parses(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True


def test_every_schema_answer_parses_after_free_thinking(outputs: dict[str, ChatCompletion]) -> None:
    from jsonschema import validate

    for k in range(N_SCHEMA):
        message = outputs[f"schema-{k}"].choices[0].message
        assert message.reasoning, k  # type: ignore[attr-defined]
        assert "</think>" not in (message.content or "")
        answer = json.loads(message.content or "")
        validate(answer, SCHEMA)
        # The fields in the schema's order (verdict first), not sorted (score would be first).
        assert list(answer) == list(SCHEMA["properties"]), answer
    # The same prompts without a schema: the model does not write JSON by itself.
    parsed = sum(_parses(outputs[f"control-{k}"].choices[0].message.content)
                 for k in range(N_CONTROL))  # fmt: skip
    assert parsed <= 2, parsed


def test_a_thinking_budget_ends_the_thinking_and_the_schema_follows(
    outputs: dict[str, ChatCompletion],
) -> None:
    budget = outputs["budget"]
    usage = budget.usage
    assert usage is not None and usage.completion_tokens_details is not None
    # The low effort's budget of 8 tokens, plus the </think> the engine forced.
    assert usage.completion_tokens_details.reasoning_tokens == 9
    assert budget.choices[0].message.reasoning  # type: ignore[attr-defined]
    assert json.loads(budget.choices[0].message.content or "")["verdict"] in ("yes", "no", "maybe")


def test_three_choices_each_with_its_own_thinking(outputs: dict[str, ChatCompletion]) -> None:
    n3 = outputs["n3"]
    assert [c.index for c in n3.choices] == [0, 1, 2]
    assert all(c.message.reasoning for c in n3.choices)  # type: ignore[attr-defined]
    assert len({(c.message.content, c.message.reasoning) for c in n3.choices}) > 1  # type: ignore[attr-defined]


def test_logprobs_of_the_answer_tokens(outputs: dict[str, ChatCompletion]) -> None:
    choice = outputs["logprobs"].choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    tokens = choice.logprobs.content
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in tokens)
    # Every answer token and only those: their bytes join to the answer's, exactly.
    joined = b"".join(bytes(t.bytes or ()) for t in tokens)
    assert joined == (choice.message.content or "").encode()


def test_a_named_tool_is_called_with_arguments_that_parse(
    outputs: dict[str, ChatCompletion],
) -> None:
    choice = outputs["tool"].choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments)["unit"] in ("celsius", "fahrenheit")  # type: ignore[union-attr]


def test_parallel_tool_calls_false_makes_one_call(outputs: dict[str, ChatCompletion]) -> None:
    choice = outputs["one-call"].choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1  # the grammar allows one call, not more
    assert calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert isinstance(json.loads(calls[0].function.arguments), dict)  # type: ignore[union-attr]
