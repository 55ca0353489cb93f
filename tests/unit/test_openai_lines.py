"""One OpenAI batch input line as an item, and an item as an output or error line.

A line that is not a request of the batch raises (a fault of the file); a line whose request
body is at fault becomes a refused item naming the body's field as OpenAI does (`temperature`,
not `body.temperature`); the request vocabulary reaches the item's params; and every output
line validates against the official `openai` SDK's types."""

from __future__ import annotations

import json
from datetime import UTC
from datetime import datetime
from typing import Any

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from thinkbatch.errors import REJECTION_CODES
from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.jobs import ItemIn
from thinkbatch.jobs import RefusedItem
from thinkbatch.jobs import ResultRow
from thinkbatch.openai import lines
from thinkbatch.openai.lines import CHAT
from thinkbatch.openai.lines import COMPLETIONS
from thinkbatch.openai.lines import parse_line
from worker.engine import token_logprob

LINE = Limits(max_depth=32, items_key=None)
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip


def line(url: str = CHAT, **body: Any) -> bytes:
    base: dict[str, Any] = {"model": "m"}
    if url == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "Once upon"
    return json.dumps(
        {"custom_id": "a", "method": "POST", "url": url, "body": {**base, **body}}
    ).encode()


def item(raw: bytes, url: str = CHAT) -> ItemIn:
    parsed = parse_line(raw, url, LINE)
    assert isinstance(parsed.item, ItemIn), parsed.item
    return parsed.item


def refused(raw: bytes, url: str = CHAT) -> RefusedItem:
    parsed = parse_line(raw, url, LINE)
    assert isinstance(parsed.item, RefusedItem), parsed.item
    assert parsed.item.code in lines.REQUEST_CODES
    return parsed.item


# --- input ------------------------------------------------------------------------------------


def test_frequency_penalty_reaches_the_item() -> None:
    params = item(line(frequency_penalty=0.5, presence_penalty=-0.5)).params
    assert params is not None
    assert params.frequency_penalty == 0.5
    assert params.presence_penalty == -0.5


def test_the_request_vocabulary_reaches_the_item() -> None:
    params = item(
        line(
            n=2, min_p=0.1, logit_bias={"50256": -100}, stop_token_ids=[7],
            include_stop_str_in_output=True, logprobs=True, top_logprobs=3,
            tools=[TOOL], tool_choice="auto", reasoning_effort="low", parallel_tool_calls=False,
            user="u", metadata={"k": "v"}, store=False, service_tier="flex",
            safety_identifier="s", prompt_cache_key="p", stream=False,
        )
    ).params  # fmt: skip
    assert params is not None
    assert params.overrides() == {
        "n": 2, "min_p": 0.1, "logit_bias": {"50256": -100}, "stop_token_ids": [7],
        "include_stop_str_in_output": True, "logprobs": True, "top_logprobs": 3,
        "tools": [TOOL], "tool_choice": "auto", "reasoning_effort": "low",
        "parallel_tool_calls": False,
    }  # fmt: skip


def test_structured_answers_reach_the_item() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    params = item(line(response_format=fmt)).params
    assert params is not None and params.overrides()["response_format"]["json_schema"] == {
        "name": "x", "schema": schema, "strict": True}  # fmt: skip
    params = item(line(COMPLETIONS, structured_outputs={"regex": "[0-9]+"}), COMPLETIONS).params
    assert params is not None and params.overrides()["structured_outputs"] == {"regex": "[0-9]+"}


def test_a_completions_logprobs_is_the_top_count() -> None:
    params = item(line(COMPLETIONS, logprobs=3, max_tokens=5), COMPLETIONS).params
    assert params is not None
    assert (params.logprobs, params.top_logprobs, params.max_tokens) == (True, 3, 5)
    params = item(line(COMPLETIONS, logprobs=0), COMPLETIONS).params
    assert params is not None and (params.logprobs, params.top_logprobs) == (True, 0)
    # Bounded as top_logprobs is (the one table), named as the request names it.
    assert refused(line(COMPLETIONS, logprobs=21), COMPLETIONS).param == "logprobs"
    assert refused(line(COMPLETIONS, logprobs=True), COMPLETIONS).param == "logprobs"
    # A completion request has no top_logprobs field, in OpenAI's API or vLLM's.
    assert refused(line(COMPLETIONS, top_logprobs=2), COMPLETIONS).code == "unknown_parameter"


def test_messages_of_a_tool_conversation() -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "Be terse."}], "name": "d"},
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    got = item(line(messages=messages, tools=[TOOL]))
    assert got.messages is not None
    assert [m.role for m in got.messages] == ["system", "user", "assistant", "tool"]
    assert got.messages[0].content == "Be terse."
    assert got.messages[2].tool_calls is not None and got.messages[2].content is None
    assert got.messages[3].tool_call_id == "c1"


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty", "invalid_value"),
        ({"frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
        ({"frequency_penalty": "0.5"}, "frequency_penalty", "invalid_type"),
        ({"temperature": 9}, "temperature", "invalid_value"),
        ({"colour": "red"}, "colour", "unknown_parameter"),
        ({"functions": []}, "functions", "unknown_parameter"),
        ({"n": 0}, "n", "invalid_value"),
        ({"tool_choice": "sometimes", "tools": [TOOL]}, "tool_choice", "invalid_value"),
        ({"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]},
         "tool_choice.function.name", "missing_required_parameter"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
        ({"max_completion_tokens": 5, "max_tokens": 5}, "max_tokens", "invalid_value"),
        ({"chat_template_kwargs": {"enable_thinking": 1}},
         "chat_template_kwargs.enable_thinking", "invalid_type"),
        ({"stream": True}, "stream", "invalid_value"),
        ({"stream": 0}, "stream", "invalid_value"),  # not false: a boolean is a boolean
        ({"stream": 0.0}, "stream", "invalid_value"),
        ({"structured_outputs": {"json_object": 1}}, "structured_outputs.json_object",
         "invalid_type"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
        ({"service_tier": "gold"}, "service_tier", "invalid_value"),
        ({"metadata": {"k": 1}}, "metadata.k", "invalid_type"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "invalid_value"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].type", "invalid_value"),
        ({"model": None}, "model", "invalid_type"),
    ],
)  # fmt: skip
def test_a_bad_body_refuses_its_line_alone_naming_the_field(
    body: dict[str, Any], param: str, code: str
) -> None:
    got = refused(line(**body))
    assert (got.param, got.code) == (param, code), got
    assert got.custom_id == "a"
    assert got.message.startswith(f"{param}: "), got.message
    assert "body." not in got.message and "literal[" not in got.message


def test_an_unknown_reasoning_effort_is_refused() -> None:
    # What spans fields (check_params) is checked with the job service's item checks, at
    # create (tests/api/test_openai_inputs.py); here, what a field's own type refuses.
    got = refused(line(reasoning_effort="max"))
    assert got.param == "reasoning_effort"


def test_a_body_that_is_not_an_object_or_has_no_model() -> None:
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": [1]}).encode()
    got = refused(raw)
    assert got.param is None and got.message == "must be a JSON object (the request)"
    body = {"messages": [{"role": "user", "content": "x"}]}
    raw = json.dumps({"custom_id": "a", "method": "POST", "url": CHAT, "body": body}).encode()
    got = refused(raw)
    assert (got.param, got.code) == ("model", "missing_required_parameter")


def test_tools_need_the_chat_endpoint() -> None:
    for field, value in (("tools", [TOOL]), ("tool_choice", "auto"),
                         ("parallel_tool_calls", True)):  # fmt: skip
        got = refused(line(COMPLETIONS, **{field: value}), COMPLETIONS)
        assert got.param == field and CHAT in got.message


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"custom_id": "a", ', None),
        (b"[1]", None),
        (b'{"method": "POST", "url": "/v1/chat/completions", "body": {}}', "custom_id"),
        (b'{"custom_id": "", "method": "POST", "url": "/v1/chat/completions", "body": {}}',
         "custom_id"),
        (b'{"custom_id": "a", "method": "GET", "url": "/v1/chat/completions", "body": {}}',
         "method"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}', "url"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}', "body"),
        (b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {},'
         b' "x": 1}', "x"),
    ],
)  # fmt: skip
def test_a_line_that_is_no_request_of_the_batch_is_a_fault_of_the_file(
    raw: bytes, param: str | None
) -> None:
    with pytest.raises(InputError) as error:
        parse_line(raw, CHAT, LINE)
    assert error.value.param == param


# --- output -----------------------------------------------------------------------------------


def row(status: str = "succeeded", choices: list[dict[str, Any]] | None = None,
        **fields: Any) -> ResultRow:  # fmt: skip
    values: dict[str, Any] = {
        "item_id": 7, "seq": 0, "custom_id": "a", "status": status, "attempts": 1,
        "error_code": None, "error_message": None, "started_at": None,
        "finished_at": datetime(2026, 1, 1, tzinfo=UTC), "thinking": "hmm", "answer": "hi",
        "finish_reason": "stop", "thinking_truncated": False, "prompt_tokens": 3,
        "completion_tokens": 4, "reasoning_tokens": 1, "choices": choices,
    }  # fmt: skip
    return ResultRow(**{**values, **fields})


def logprobs(*tokens: str) -> list[dict[str, Any]]:
    return [
        {"token": t, "logprob": -0.5, "bytes": list(t.encode()),
         "top_logprobs": [{"token": t, "logprob": -0.5, "bytes": list(t.encode())},
                          {"token": "x", "logprob": -2.0, "bytes": [120]}]}
        for t in tokens
    ]  # fmt: skip


CALL = {"id": "call_7_0_0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}  # fmt: skip
CHOICES = [
    {"thinking": "t0", "answer": '{"a":1}', "finish_reason": "stop", "thinking_truncated": False,
     "completion_tokens": 3, "reasoning_tokens": 1, "json": True, "logprobs": logprobs("{", "}")},
    {"thinking": "", "answer": "", "finish_reason": "tool_calls", "thinking_truncated": True,
     "completion_tokens": 2, "reasoning_tokens": 0, "tool_calls": [CALL], "logprobs": []},
]  # fmt: skip


def rendered(r: ResultRow, endpoint: str = CHAT) -> dict[str, Any]:
    data = lines.render(r, endpoint=endpoint, model="m")
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    out: dict[str, Any] = json.loads(data)
    return out


def test_a_plain_chat_line_validates_as_the_sdks_chat_completion() -> None:
    out = rendered(row())
    body = ChatCompletion.model_validate(out["response"]["body"], strict=True)
    assert body.service_tier == "default"
    [choice] = body.choices
    assert (choice.index, choice.message.content, choice.logprobs) == (0, "hi", None)
    assert "tool_calls" not in out["response"]["body"]["choices"][0]["message"]


def test_every_choice_with_logprobs_and_tool_calls() -> None:
    out = rendered(row(choices=CHOICES, completion_tokens=5))
    body = ChatCompletion.model_validate(out["response"]["body"], strict=True)
    first, second = body.choices
    assert (first.index, second.index) == (0, 1)
    assert json.loads(first.message.content or "") == {"a": 1}
    assert first.logprobs is not None and first.logprobs.content is not None
    assert [t.token for t in first.logprobs.content] == ["{", "}"]
    assert [t.token for t in first.logprobs.content[0].top_logprobs] == ["{", "x"]
    assert second.finish_reason == "tool_calls" and second.message.content is None
    assert second.message.tool_calls is not None
    assert second.message.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    raw = out["response"]["body"]["choices"]
    assert raw[1]["message"]["reasoning"] is None and raw[1]["thinking_truncated"] is True
    assert raw[0]["message"]["reasoning"] == raw[0]["message"]["reasoning_content"] == "t0"
    assert body.usage is not None and body.usage.completion_tokens == 5


def test_a_completion_line_has_the_legacy_logprobs() -> None:
    choices = [
        {**CHOICES[0], "answer": "ab", "logprobs": logprobs("a", "b")},
        {**CHOICES[0], "answer": "x", "logprobs": logprobs("x"), "finish_reason": "length"},
    ]
    out = rendered(row(choices=choices), COMPLETIONS)
    body = Completion.model_validate(out["response"]["body"], strict=True)
    first, second = body.choices
    assert first.logprobs is not None
    assert first.logprobs.tokens == ["a", "b"] and first.logprobs.text_offset == [0, 1]
    assert first.logprobs.token_logprobs == [-0.5, -0.5]
    assert first.logprobs.top_logprobs == [{"a": -0.5, "x": -2.0}, {"b": -0.5, "x": -2.0}]
    assert second.finish_reason == "length" and second.text == "x"
    assert "service_tier" not in out["response"]["body"]


def test_a_refused_line_is_a_400_naming_its_param() -> None:
    r = row("failed", attempts=0, error_code="invalid_value", error_param="temperature",
            error_message="temperature: Input should be less than or equal to 2",
            thinking=None, answer=None, finish_reason=None)  # fmt: skip
    out = rendered(r)
    assert out["error"] is None and out["response"]["status_code"] == 400
    assert out["response"]["body"] == {
        "error": {
            "message": "temperature: Input should be less than or equal to 2",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": "invalid_value",
        }
    }


def test_an_engine_failure_is_a_500() -> None:
    r = row("failed", error_code="engine_error", error_message="boom")
    out = rendered(r)
    assert out["response"]["status_code"] == 500
    assert out["response"]["body"]["error"]["type"] == "server_error"


@pytest.mark.parametrize("code", sorted(REJECTION_CODES))
def test_a_request_the_engine_refused_is_a_400_a_retry_would_not_change(code: str) -> None:
    r = row("failed", error_code=code, error_message="xgrammar: cannot compile",
            error_param=None)  # fmt: skip
    out = rendered(r)
    assert out["response"]["status_code"] == 400, code
    assert out["response"]["body"]["error"]["type"] == "invalid_request_error"


def test_legacy_offsets_count_characters_when_tokens_split_one() -> None:
    # "é!" as a byte-level vocabulary may spell it: two tokens for the é, one for the "!".
    parts = [b"\xc3", b"\xa9", b"!"]
    entries = [token_logprob(p, -0.5) for p in parts]
    assert [e["token"] for e in entries] == ["bytes:\\xc3", "bytes:\\xa9", "!"]
    choices = [{**CHOICES[0], "answer": "é!",
                "logprobs": [{**e, "top_logprobs": [e]} for e in entries]}]  # fmt: skip
    out = rendered(row(choices=choices), COMPLETIONS)
    body = Completion.model_validate(out["response"]["body"], strict=True)
    lp = body.choices[0].logprobs
    assert lp is not None and lp.text_offset == [0, 0, 1]
    # Two different half-characters stay two keys of top_logprobs.
    assert lp.top_logprobs is not None and len({k for t in lp.top_logprobs for k in t}) == 3
