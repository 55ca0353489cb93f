"""The request vocabulary end to end on the fake engine: what each field does to the stored
result (choices, JSON answers, tool calls, logprobs, reasoning effort), and what is refused at
submit, naming the field. The same fields on the vLLM engine: tests/e2e/test_vocabulary_vllm.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from tests.helpers import job_records
from tests.helpers import make_settings
from tests.helpers import submit_job
from tests.runner_harness import Harness
from tests.runner_harness import wait_status
from thinkbatch.errors import InputError
from thinkbatch.sampling import merge_layers
from thinkbatch.sampling import resolve_sampling

MSG = [{"role": "user", "content": "What is 2 + 2?"}]
SCHEMA = {
    "type": "object",
    "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
    "required": ["reasoning", "answer"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture
def harness(database_url: str, redis_url: str, db: sa.Engine) -> Iterator[Harness]:
    h = Harness(make_settings(database_url, redis_url, engine_extra_args={"step_s": 0.001}), db)
    yield h
    h.close()


def _run(harness: Harness, body: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    job_id = submit_job(harness.db, harness.settings, body)
    thread, _ = harness.drive(harness.runner(), job_id)
    thread.join(30)
    wait_status(harness.db, job_id, {status})
    return job_records(harness.db, harness.settings, job_id)


def test_each_field_shapes_the_stored_result(harness: Harness) -> None:
    items = [
        {"custom_id": "schema", "messages": MSG, "params": {"response_format": JSON_SCHEMA}},
        {"custom_id": "object", "messages": MSG,
         "params": {"response_format": {"type": "json_object"}}},
        {"custom_id": "n3", "messages": MSG, "params": {"n": 3}},
        {"custom_id": "lp", "messages": MSG, "params": {"logprobs": True, "top_logprobs": 2}},
        {"custom_id": "lp-utf8", "messages": [{"role": "user", "content": "Ça va, 東京? 🙂"}],
         "params": {"logprobs": True, "top_logprobs": 1}},
        {"custom_id": "tool", "messages": [{"role": "user", "content": "[[tool]] weather?"}],
         "params": {"tools": [WEATHER]}},
        {"custom_id": "named", "messages": MSG, "params": {"tools": [WEATHER], "tool_choice": {
            "type": "function", "function": {"name": "get_weather"}}}},
        {"custom_id": "required", "messages": MSG,
         "params": {"tools": [WEATHER], "tool_choice": "required"}},
        {"custom_id": "choice", "messages": MSG,
         "params": {"structured_outputs": {"choice": ["yes", "no"]}}},
        {"custom_id": "plain", "messages": MSG},
    ]  # fmt: skip
    got = _run(harness, {"items": items})
    schema = got["schema"]
    assert schema["thinking"] and json.loads(schema["answer"]) == schema["answer_json"]
    assert set(schema["answer_json"]) == {"reasoning", "answer"}
    # The schema's property order is the answer's: params are stored as sent (json, not jsonb).
    assert list(schema["answer_json"]) == ["reasoning", "answer"]
    assert isinstance(got["object"]["answer_json"], dict)

    n3 = got["n3"]
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    assert len({c["answer"] for c in n3["choices"]}) == 3  # each choice generated on its own
    assert n3["answer"] == n3["choices"][0]["answer"]
    assert n3["usage"]["completion_tokens"] == sum(c["completion_tokens"] for c in n3["choices"])

    lp = got["lp"]["logprobs"]
    assert lp and all(len(t["top_logprobs"]) == 2 for t in lp)
    # The answer's tokens only, and all of them: their texts join to the answer exactly.
    assert "".join(t["token"] for t in lp) == got["lp"]["answer"]
    # Characters split across tokens: each token's bytes are its own, and they join to the
    # answer's; a half-character has no text of its own (OpenAI's `bytes:` spelling).
    utf8 = got["lp-utf8"]
    assert "京" in utf8["answer"] and "🙂" in utf8["answer"]
    assert b"".join(bytes(t["bytes"]) for t in utf8["logprobs"]) == utf8["answer"].encode()
    halves = [t["token"] for t in utf8["logprobs"] if t["token"].startswith("bytes:\\x")]
    assert len(halves) >= 3 * 2 and "\ufffd" not in "".join(t["token"] for t in utf8["logprobs"])

    tool = got["tool"]
    assert tool["finish_reason"] == "tool_calls" and tool["answer"] == ""
    call = tool["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
    named = got["named"]["tool_calls"]
    assert [c["function"]["name"] for c in named] == ["get_weather"]
    assert json.loads(named[0]["function"]["arguments"]) == {"city": "x"}
    assert got["required"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert got["choice"]["answer"] == "yes"
    plain = got["plain"]
    assert plain["choices"] is None and plain["tool_calls"] is None and plain["logprobs"] is None


def test_an_answer_that_breaks_its_schema_fails_that_item_alone(harness: Harness) -> None:
    items = [
        {"custom_id": "bad", "messages": [{"role": "user", "content": "[[bad-json]]"}]},
        {"custom_id": "refused", "messages": [{"role": "user", "content": "[[grammar-error]]"}]},
        {"custom_id": "good", "messages": MSG},
    ]
    got = _run(harness, {"items": items, "params": {"response_format": JSON_SCHEMA}})
    assert got["good"]["status"] == "succeeded" and got["good"]["answer_json"]
    assert got["bad"]["status"] == "failed" and got["bad"]["error"]["code"] == "answer_invalid"
    assert got["bad"]["attempts"] == harness.settings.max_attempts  # retried: sampling may differ
    assert got["refused"]["error"]["code"] == "grammar_error"
    assert got["refused"]["attempts"] == 1  # the engine's refusal does not change on retry


def test_reasoning_effort_is_a_budget_or_no_thinking(harness: Harness) -> None:
    items = [
        {"custom_id": "none", "messages": MSG, "params": {"reasoning_effort": "none"}},
        {"custom_id": "min", "messages": MSG, "params": {"reasoning_effort": "minimal"}},
        {"custom_id": "high", "messages": MSG, "params": {"reasoning_effort": "high"}},
    ]
    efforts = {"minimal": 4, "low": 8, "medium": 16, "high": None}
    harness.settings = harness.settings.model_copy(update={"reasoning_effort_budgets": efforts})
    got = _run(harness, {"items": items})
    assert got["none"]["thinking"] == "" and got["none"]["usage"]["reasoning_tokens"] == 0
    assert got["min"]["usage"]["reasoning_tokens"] == 5 and got["min"]["thinking_truncated"]
    assert got["high"]["usage"]["reasoning_tokens"] > 5 and not got["high"]["thinking_truncated"]


def test_groups_replace_the_jobs_as_a_whole() -> None:
    job = {"tools": [WEATHER], "tool_choice": "required", "logprobs": True, "top_logprobs": 3}
    item = {"response_format": {"type": "json_object"}, "logprobs": False}
    merged = merge_layers(job, item)
    assert "tools" not in merged and "tool_choice" not in merged and "top_logprobs" not in merged
    s = resolve_sampling(job, item, default_max_tokens=64)
    assert s.tool_mode == "none" and s.logprobs is None and s.structured is not None
    # An effort's budget at or above max_tokens cannot bind: none is applied.
    high = resolve_sampling({"reasoning_effort": "medium", "max_tokens": 100}, None,
                            default_max_tokens=64)  # fmt: skip
    assert high.enable_thinking and high.thinking_budget is None
    # The item's effort overrides the job's budget, even with no budget of its own.
    s = resolve_sampling(
        {"thinking_budget": 10}, {"reasoning_effort": "high"}, default_max_tokens=64
    )
    assert s.thinking_budget is None
    s = resolve_sampling(
        {"reasoning_effort": "none"}, {"thinking_budget": 10}, default_max_tokens=64
    )
    assert not s.enable_thinking


def test_a_schema_reaches_the_engine_in_the_order_it_was_sent() -> None:
    a = resolve_sampling({"response_format": JSON_SCHEMA}, None, default_max_tokens=8)
    b = resolve_sampling(None, {"response_format": JSON_SCHEMA}, default_max_tokens=8)
    assert a.structured == b.structured  # the engine's grammar cache keys on this spec
    assert a.structured is not None and isinstance(a.structured.spec, str)
    # The grammar writes properties in their listed order: reasoning before answer, as sent.
    assert list(json.loads(a.structured.spec)["properties"]) == ["reasoning", "answer"]
    assert list(json.loads(a.structured.spec)) == list(SCHEMA)
    swapped = {**SCHEMA, "properties": dict(reversed(SCHEMA["properties"].items()))}
    # Tools below use the sent order, which is not the sorted one (answer < reasoning).
    as_sent = {**SCHEMA, "properties": {"reasoning": {"type": "string"}, "answer": {}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": swapped}}
    c = resolve_sampling(None, {"response_format": fmt}, default_max_tokens=8)
    assert c.structured is not None and c.structured != a.structured
    assert list(json.loads(str(c.structured.spec))["properties"]) == ["answer", "reasoning"]
    # The same for a tool's arguments and for the calls `required` builds.
    tool = {"type": "function", "function": {"name": "f", "parameters": as_sent}}
    named = {"type": "function", "function": {"name": "f"}}
    for choice, path in ((named, ("properties",)),
                         ("required", ("$defs", "tool_0", "properties"))):  # fmt: skip
        s = resolve_sampling({"tools": [tool], "tool_choice": choice}, None, default_max_tokens=8)
        assert s.structured is not None
        node: Any = json.loads(str(s.structured.spec))
        for step in path:
            node = node[step]
        assert list(node) == ["reasoning", "answer"], choice


REFUSED = [
    ({"n": 9}, "items[0].params.n", "MAX_CHOICES"),
    ({"n": 0}, "items[0].params.n", "greater than or equal to 1"),
    ({"top_logprobs": 3}, "items[0].params.top_logprobs", "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "items[0].params.top_logprobs", "20"),
    ({"reasoning_effort": "low", "thinking_budget": 5}, "items[0].params.reasoning_effort",
     "not both"),
    ({"reasoning_effort": "extreme"}, "items[0].params.reasoning_effort", "'none'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
     "items[0].params.structured_outputs", "not both"),
    ({"response_format": {"type": "json_schema"}}, "items[0].params.response_format",
     "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}, "items[0].params.response_format.json_schema.schema", "JSON Schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "items[0].params.structured_outputs.regex",
     "regular expression"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "items[0].params.structured_outputs",
     "exactly one"),
    ({"structured_outputs": {"regex": "x" * 70000}}, "items[0].params.structured_outputs",
     "MAX_GRAMMAR_CHARS"),
    ({"structured_outputs": {"json_object": 1}}, "items[0].params.structured_outputs.json_object",
     "valid boolean"),
    ({"structured_outputs": {"json_object": 1.0}},
     "items[0].params.structured_outputs.json_object", "valid boolean"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "items[0].params.tools[0].function.parameters", "type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"a": {"type": "string"}}}}}]},
     "items[0].params.tools[0].function.parameters", "type 'object'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/A", "$defs": {"A": {"type": "array"}}}}}]},
     "items[0].params.tools[0].function.parameters", "not type 'array'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/a%20b", "$defs": {"a b": {}}}}}},
     "items[0].params.response_format.json_schema.schema", "escaped"),
    ({"tool_choice": "auto"}, "items[0].params.tool_choice", "needs tools"),
    ({"parallel_tool_calls": False}, "items[0].params.parallel_tool_calls", "needs tools"),
    ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "items[0].params.parallel_tool_calls",
     "boolean"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "items[0].params.tool_choice.function.name", "not one of the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "items[0].params.tool_choice", "auto"),
    ({"tools": [WEATHER, WEATHER]}, "items[0].params.tools[1].function.name", "duplicate"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "items[0].params.tools",
     "exclude each other"),
    ({"logit_bias": {"abc": 1}}, "items[0].params.logit_bias.abc", "pattern"),
    ({"logit_bias": {"1": 5, "01": -5}}, "items[0].params.logit_bias.01", "pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#"}}}}, "items[0].params.response_format.json_schema.schema", "reference loop"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "#/$defs/missing"}}}}, "items[0].params.response_format.json_schema.schema",
     "points at nothing"),
    ({"structured_outputs": {"json": {"$ref": "http://169.254.169.254/latest"}}},
     "items[0].params.structured_outputs.json", "not a reference within the schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "allOf": [{"$ref": "#"}]}}}]},
     "items[0].params.tools[0].function.parameters", "reference loop"),
    ({"logit_bias": {"5": 101}}, "items[0].params.logit_bias.5", "100"),
    ({"stop_token_ids": [-1]}, "items[0].params.stop_token_ids[0]", "greater than"),
    ({"min_p": 1.5}, "items[0].params.min_p", "1"),
    ({"n": 2, "temperature": 0}, "items[0].params.n", "greedy"),
    ({"logprobs": True, "top_logprobs": 20, "max_tokens": 8000, "n": 2},
     "items[0].params.logprobs", "MAX_LOGPROB_ENTRIES"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("params", "param", "words"), REFUSED, ids=[r[1] + "-" + str(i) for i, r in enumerate(REFUSED)]
)
def test_what_cannot_run_is_refused_at_submit_naming_the_field(
    harness: Harness, params: dict[str, Any], param: str, words: str
) -> None:
    body = {"items": [{"messages": MSG, "params": params}]}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, body)
    assert caught.value.param == param, caught.value.message
    assert words in caught.value.message
    with harness.db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar_one() == 0


def test_what_spans_the_layers_is_checked_whatever_comes_first(harness: Harness) -> None:
    prompt_item = {"custom_id": "raw", "prompt": "hello"}
    # The job's params after its items in the body: still refused, naming the item.
    body = {"items": [prompt_item], "params": {"tools": [WEATHER]}}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, body)
    assert caught.value.param == "items[0].prompt"
    lp = {"items": [{"messages": MSG, "params": {"n": 8}}],
          "params": {"logprobs": True, "top_logprobs": 20, "max_tokens": 1000}}  # fmt: skip
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, lp)
    assert caught.value.code == "logprobs_too_large"
    greedy = {"items": [{"messages": MSG, "params": {"n": 2}}], "params": {"temperature": 0}}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, greedy)
    assert caught.value.param == "items[0].params.n" and "greedy" in caught.value.message
    greedy = {"items": [{"messages": MSG, "params": {"temperature": 0}}], "params": {"n": 2}}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, greedy)
    assert caught.value.param == "items[0].params.temperature"
    # An item whose own group replaces the job's is fine.
    ok = {"items": [{**prompt_item, "params": {"structured_outputs": {"choice": ["a"]}}}],
          "params": {"tools": [WEATHER]}}  # fmt: skip
    assert submit_job(harness.db, harness.settings, ok)


def _tool(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


# Two tools defining one name differently, and a recursive one: references of every kind.
def _defining_v(name: str, kind: str) -> dict[str, Any]:
    """A tool whose one argument is of the type its own `$defs/V` names."""
    return _tool(name, {"type": "object", "properties": {"x": {"$ref": "#/$defs/V"}},
                        "required": ["x"], "$defs": {"V": {"type": kind}}})  # fmt: skip


DEFS_A = _defining_v("a", "string")
DEFS_B = _defining_v("b", "integer")
DRAFT7 = _tool("c", {"$id": "urn:args", "type": "object", "required": ["x"],
                     "properties": {"x": {"$ref": "#/definitions/V"}},
                     "definitions": {"V": {"type": "boolean"}}})  # fmt: skip
ZOD = _tool("z", {"$ref": "#/$defs/Args", "$defs": {"Args": {
    "type": "object", "properties": {"y": {"type": "string"}}, "required": ["y"]}}})  # fmt: skip
TREE = _tool("tree", {"type": "object", "properties": {"kids": {"type": "array", "items": {
    "$ref": "#"}}, "tag": {"const": {"$ref": "data, not a reference"}}}})  # fmt: skip


def test_required_tools_keep_their_references_in_the_grammar_and_the_check() -> None:
    from thinkbatch.answers import AnswerInvalid
    from thinkbatch.answers import parse_answer

    xgrammar = pytest.importorskip("xgrammar")
    tools = [DEFS_A, DEFS_B, TREE, DRAFT7, ZOD]
    s = resolve_sampling({"tools": tools, "tool_choice": "required"}, None, default_max_tokens=8)
    assert s.structured is not None
    xgrammar.Grammar.from_json_schema(str(s.structured.spec))  # the engine's compiler takes it
    good = [{"name": "a", "parameters": {"x": "s"}}, {"name": "b", "parameters": {"x": 3}},
            {"name": "tree", "parameters": {"kids": [{"kids": []}]}},
            {"name": "c", "parameters": {"x": True}},
            {"name": "z", "parameters": {"y": "q"}}]  # fmt: skip
    calls = parse_answer(json.dumps(good), s, "c").tool_calls
    assert calls is not None
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        g["parameters"] for g in good
    ]
    for bad in ({"name": "a", "parameters": {"x": 3}}, {"name": "b", "parameters": {"x": "s"}},
                {"name": "tree", "parameters": {"kids": [{"kids": 1}]}},
                {"name": "c", "parameters": {"x": 1}},
                {"name": "z", "parameters": {}}):  # fmt: skip
        with pytest.raises(AnswerInvalid):
            parse_answer(json.dumps([bad]), s, "c")
    # Data is not rewritten: the const keeps its "$ref" key as sent.
    tree = json.loads(str(s.structured.spec))["$defs"]["tool_2"]
    assert tree["properties"]["tag"] == {"const": {"$ref": "data, not a reference"}}
    assert tree["properties"]["kids"]["items"] == {"$ref": "#/$defs/tool_2"}


def test_tool_call_arguments_are_always_json_text() -> None:
    from thinkbatch.answers import parse_answer

    s = resolve_sampling({"tools": [WEATHER]}, None, default_max_tokens=8)
    answer = '<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'
    calls = parse_answer(answer, s, "c").tool_calls
    assert calls is not None and json.loads(calls[0]["function"]["arguments"]) == "Paris"


def test_parallel_tool_calls_false_allows_one_call_per_choice() -> None:
    from thinkbatch.answers import parse_answer

    one = {"tools": [WEATHER], "parallel_tool_calls": False}
    required = resolve_sampling({**one, "tool_choice": "required"}, None, default_max_tokens=8)
    assert required.structured is not None and required.structured.schema is not None
    assert required.structured.schema["maxItems"] == 1  # the grammar allows one call
    many = resolve_sampling({"tools": [WEATHER], "tool_choice": "required"}, None,
                            default_max_tokens=8)  # fmt: skip
    assert many.structured is not None and "maxItems" not in (many.structured.schema or {})
    # auto: the first call is kept, the others dropped (vLLM's server drops them too), and no
    # call's block stays in the content.
    answer = (
        'Two. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    parsed = parse_answer(answer, resolve_sampling(one, None, default_max_tokens=8), "c")
    assert parsed.content == "Two." and parsed.tool_calls is not None
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [
        {"city": "Paris"}
    ]
    both = parse_answer(
        answer, resolve_sampling({"tools": [WEATHER]}, None, default_max_tokens=8), "c"
    )
    assert both.tool_calls is not None and len(both.tool_calls) == 2
    # An item's tools without it replace the job's answer group, parallel_tool_calls with it.
    merged = merge_layers(one, {"tools": [WEATHER]})
    assert "parallel_tool_calls" not in merged


def _lp(*tokens: str) -> list[dict[str, Any]]:
    return [{"token": t, "logprob": -0.1, "bytes": list(t.encode())} for t in tokens]


@pytest.mark.parametrize(
    ("text", "tokens", "kept"),
    [
        # The line breaks after </think> are the separator's tokens, not the answer's.
        ("<think>t</think>\n\nHi.", ["<think>", "t", "</think>", "\n\n", "Hi", ".", ""],
         ["Hi", "."]),
        # A stop string the engine cut from the text keeps its tokens' logprobs: not the answer's.
        ("<think>t</think>\n\nDone. ", ["<think>", "t", "</think>", "\n\n", "Done", ". ",
                                          "EN", "D"], ["Done", ". "]),
        # A token holding both separator and answer text stays whole.
        ("<think>t</think>\n\n  def", ["<think>", "t", "</think>", "\n\n  ", " def"],
         ["\n\n  ", " def"]),
        ("<think>t</think>", ["<think>", "t", "</think>", ""], []),
    ],
)  # fmt: skip
def test_answer_logprobs_are_the_answers_tokens(
    text: str, tokens: list[str], kept: list[str]
) -> None:
    from thinkbatch.thinking import split_thinking
    from worker.engine import Generation
    from worker.runner.writer import _answer_logprobs

    split = split_thinking(text)
    gen = Generation(token_ids=list(range(len(tokens))), text=text, finish_reason="stop",
                     prompt_tokens=1, logprobs=_lp(*tokens))  # fmt: skip
    got = [e["token"] for e in _answer_logprobs(gen, 3, split)]
    assert got == kept


def test_answer_constraints_are_counted_as_the_engine_is_handed_them(harness: Harness) -> None:
    # MAX_GRAMMAR_CHARS counts a regex's and a grammar's own characters: as JSON text, each
    # backslash and each line break was two, and a regex of 44,000 characters was refused.
    limit = harness.settings.max_grammar_chars
    regex = "\\d" * (limit // 2)
    grammar = 'root ::= "a"\n' * (limit // 13)
    assert len(json.dumps(regex)) > limit and len(json.dumps(grammar)) > limit
    for constraint in ({"regex": regex}, {"grammar": grammar}):
        body = {"items": [{"messages": MSG, "params": {"structured_outputs": constraint}}]}
        submit_job(harness.db, harness.settings, body)
    too_long = {"structured_outputs": {"regex": "a" * (limit + 1)}}
    over = {"items": [{"messages": MSG, "params": too_long}]}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, over)
    assert caught.value.code == "grammar_too_large"
    assert f"{limit + 1} characters" in caught.value.message


def test_required_tools_are_counted_as_the_calls_schema_the_engine_compiles(
    harness: Harness,
) -> None:
    # tool_choice `required` hands the engine a schema of the calls, each tool's parameters
    # wrapped in an object of its own: more than the tools take as sent. That schema is what
    # MAX_GRAMMAR_CHARS bounds.
    from thinkbatch.limits import TOOLS_MAX
    from thinkbatch.sampling import tool_call_schema

    def size(value: Any) -> int:
        return len(json.dumps(value, separators=(",", ":")))

    def tools_of(described: int) -> list[dict[str, Any]]:
        parameters = {"type": "object", "description": "d" * described}
        return [
            {"type": "function", "function": {"name": f"f{i}", "parameters": parameters}}
            for i in range(TOOLS_MAX)
        ]

    limit = harness.settings.max_grammar_chars
    described = (limit - size(tools_of(0))) // TOOLS_MAX  # the most within the limit as sent
    tools = tools_of(described)
    assert size(tools) <= limit < size(tool_call_schema(tools))
    for choice in ("auto", "required"):
        body = {"items": [{"messages": MSG, "params": {"tools": tools, "tool_choice": choice}}]}
        if choice == "auto":  # no grammar: the tools as sent
            submit_job(harness.db, harness.settings, body)
            continue
        with pytest.raises(InputError) as caught:
            submit_job(harness.db, harness.settings, body)
        assert (caught.value.code, caught.value.param) == (
            "grammar_too_large",
            "items[0].params.tools",
        )


@pytest.mark.parametrize("draft", [5, True, ["x"], {"a": 1}, None])
@pytest.mark.parametrize(
    ("params", "field"),
    [
        (lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                    "schema": s}}}, "response_format.json_schema.schema"),
        (lambda s: {"structured_outputs": {"json": s}}, "structured_outputs.json"),
        (lambda s: {"tools": [_tool("f", {**s, "type": "object"})]},
         "tools[0].function.parameters"),
    ],
)  # fmt: skip
def test_a_schema_whose_draft_is_not_a_string_is_refused_naming_it(
    harness: Harness, draft: Any, params: Any, field: str
) -> None:
    # jsonschema reads `$schema` as the draft's URI before checking anything: a number there
    # raises out of its check, which must not become a 500.
    body = {"items": [{"messages": MSG, "params": params({"$schema": draft})}]}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, body)
    assert (caught.value.code, caught.value.param) == ("invalid_schema", f"items[0].params.{field}")
    assert "$schema must be a string" in caught.value.message


def test_a_tools_parameters_may_reach_their_object_through_several_references(
    harness: Harness,
) -> None:
    chain = {"$ref": "#/$defs/X", "$defs": {"X": {"$ref": "#/$defs/Y"},
             "Y": {"type": "object", "properties": {"a": {"type": "string"}}}}}  # fmt: skip
    body = {"items": [{"messages": MSG, "params": {"tools": [_tool("f", chain)]}}]}
    submit_job(harness.db, harness.settings, body)
    to_string = {**chain, "$defs": {**chain["$defs"], "Y": {"type": "string"}}}
    body = {"items": [{"messages": MSG, "params": {"tools": [_tool("f", to_string)]}}]}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, body)
    assert "not type 'string'" in caught.value.message


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"not": {"type": "string"}}, "/not"),
        ({"type": "object", "properties": {"a": {"not": {"const": 1}}}}, "/properties/a/not"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "/dependentRequired"),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "/dependentSchemas"),
        ({"type": "object", "dependencies": {"a": ["b"]}}, "/dependencies"),
        ({"$defs": {"X": {"not": {}}}, "$ref": "#/$defs/X"}, "/$defs/X/not"),
    ],
)
def test_keywords_the_grammar_cannot_hold_are_refused_at_submit(
    harness: Harness, schema: dict[str, Any], where: str
) -> None:
    # xgrammar compiles them as if absent: its answers could break them and fail the
    # worker's check as answer_invalid, attempt after attempt.
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"items": [{"messages": MSG, "params": {"response_format": fmt}}]}
    with pytest.raises(InputError) as caught:
        submit_job(harness.db, harness.settings, body)
    assert caught.value.code == "invalid_schema"
    assert f"{where}: the engine's grammar compiler does not enforce" in caught.value.message


def test_a_property_named_like_such_a_keyword_is_data() -> None:
    from thinkbatch.jobs.asks import schema_problem

    schema = {"type": "object", "properties": {"not": {"type": "integer"}},
              "required": ["not"], "examples": [{"not": 1}]}  # fmt: skip
    assert schema_problem(schema) is None


def test_stop_strings_end_the_answer_never_the_thinking(harness: Harness) -> None:
    # The fake's output: "<think>\nThinking about What is 2 + 2?.\n</think>\n\nAnswer: ...".
    items = [
        {"custom_id": "plain", "messages": MSG},
        {"custom_id": "in-thinking", "messages": MSG, "params": {"stop": ["Thinking", "\n"]}},
        {"custom_id": "in-answer", "messages": MSG, "params": {"stop": ": "}},
        {"custom_id": "kept", "messages": MSG,
         "params": {"stop": ": ", "include_stop_str_in_output": True}},
        {"custom_id": "off", "messages": MSG, "params": {"stop": ": ", "enable_thinking": False}},
        {"custom_id": "lp", "messages": MSG, "params": {"stop": ": ", "logprobs": True}},
        {"custom_id": "n2", "messages": MSG, "params": {"stop": ": ", "n": 2}},
        {"custom_id": "json", "messages": MSG,
         "params": {"stop": '"answer"', "response_format": JSON_SCHEMA}},
    ]  # fmt: skip
    got = _run(harness, {"items": items})
    plain = got["plain"]
    assert plain["thinking"].startswith("Thinking about") and "\n" not in plain["answer"]
    # Stop strings that only the thinking holds: the item thinks and answers as without them.
    same = got["in-thinking"]
    assert (same["thinking"], same["answer"]) == (plain["thinking"], plain["answer"])
    assert same["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    cut = got["in-answer"]
    assert cut["thinking"] == plain["thinking"] and cut["answer"] == "Answer"
    assert cut["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < plain["usage"]["completion_tokens"]
    assert got["kept"]["answer"] == "Answer: "
    assert got["off"]["thinking"] == "" and got["off"]["answer"] == "Answer"
    assert "".join(t["token"] for t in got["lp"]["logprobs"]) == "Answer"
    assert [c["answer"] for c in got["n2"]["choices"]] == ["Answer", "Answer"]
    # A stop string that cuts a JSON answer cuts it again on a retry: the item fails at once,
    # saying why.
    failed = got["json"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "answer_invalid"
    assert (
        failed["attempts"] == 1
        and "cut by the stop string '\"answer\"'" in failed["error"]["message"]
    )
