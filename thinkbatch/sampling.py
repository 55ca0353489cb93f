"""Resolve a job's sampling parameters, one item's overrides and the defaults into one value.

An item's params override the job's key by key, except for three groups that replace the job's
as a whole when the item sets any member: the answer's constraint (`response_format`,
`structured_outputs`, `tools`, `tool_choice`), logprobs (`logprobs`, `top_logprobs`), and the
thinking (`reasoning_effort`, which stands for `enable_thinking` and `thinking_budget` of its
own layer). An item that asks for a regex thus never inherits the job's tools, and the API checks
each layer's group on its own (thinkbatch/jobs/combos.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Literal

from thinkbatch.schema_refs import rehomed
from thinkbatch.settings import DEFAULT_EFFORT_BUDGETS

# Qwen3's recommended sampling per mode (model card): greedy decoding makes thinking models
# loop, so unset values follow the mode instead of a single global default.
_THINKING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
_ANSWER_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    enable_thinking: bool
    ignore_eos: bool
    # None with thinking off: the budget is ignored then (documented on the field), not an error.
    thinking_budget: int | None = None
    n: int = 1
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none asked; k: the sampled token and k alternatives
    structured: Structured | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI tool objects, for the chat template
    tool_mode: Literal["none", "auto", "required", "named"] = "none"
    tool_name: str | None = None  # the function tool_choice names
    one_tool_call: bool = False  # parallel_tool_calls false: at most one call per choice


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class Structured:
    """One constraint on the answer, in the form the engine takes it. `spec` is a schema's
    compact JSON in the order it was sent: the grammar writes an object's properties in the
    order they are listed (a schema putting `reasoning` before `answer` means it), so no key is
    ever reordered. Items sending the same schema share the engine's compiled grammar."""

    kind: StructuredKind
    spec: str | list[str] | bool
    schema: dict[str, Any] | None = field(default=None, hash=False, compare=False)

    @property
    def json_answer(self) -> bool:
        """The answer must parse as JSON (and match `schema` when there is one)."""
        return self.kind in ("json", "json_object")


ANSWER_GROUP = (
    "response_format",
    "structured_outputs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
)
LOGPROBS_GROUP = ("logprobs", "top_logprobs")
THINKING_GROUP = ("reasoning_effort", "enable_thinking", "thinking_budget")
_GROUPS = (ANSWER_GROUP, LOGPROBS_GROUP)


def _layer(params: Mapping[str, Any] | None, efforts: Mapping[Any, int | None]) -> dict[str, Any]:
    """One layer's params with its reasoning_effort spelled out as the two thinking keys (a
    None budget overrides the other layer's budget: none at all)."""
    out = dict(params or {})
    effort = out.pop("reasoning_effort", None)
    if effort == "none":
        out["enable_thinking"] = False
        out["thinking_budget"] = None
    elif effort is not None:
        out["enable_thinking"] = True
        out["thinking_budget"] = efforts.get(effort)
        out["_effort"] = True  # its budget applies only where it can bind (below max_tokens)
    return out


def merge_layers(
    job_params: Mapping[str, Any] | None,
    item_params: Mapping[str, Any] | None,
    efforts: Mapping[Any, int | None] = DEFAULT_EFFORT_BUDGETS,
) -> dict[str, Any]:
    merged = _layer(job_params, efforts)
    item = _layer(item_params, efforts)
    for group in _GROUPS:
        if any(k in item for k in group):
            for k in group:
                merged.pop(k, None)
    if "thinking_budget" in item and item.get("_effort") is None:
        merged.pop("_effort", None)
    merged.update(item)
    return merged


def _canonical(schema: Mapping[str, Any]) -> str:
    # Never sort_keys: it would reorder `properties`, and with them the answer's fields.
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def tool_call_schema(tools: list[dict[str, Any]], *, one: bool = False) -> dict[str, Any]:
    """tool_choice `required`: a JSON array of one or more calls of the given functions (only
    one with `one`, parallel_tool_calls false), the schema vLLM builds for the same choice.
    Each function's parameters move to the root's `$defs`, under a name of their own, with
    their references (`#/$defs/...`, `#`) rewritten to where they now are: left inside the
    array's schema as sent, they pointed at its root, where there is nothing, and the engine
    refused the grammar. (vLLM lifts each tool's `$defs` to the root instead, which fails when
    two tools define one name differently; xgrammar follows no pointer through an array index,
    so the parameters cannot stay in `anyOf`.)"""
    calls = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        name = f"tool_{i}"
        schema = tool["function"].get("parameters") or {"type": "object"}
        defs[name] = rehomed(schema, f"/$defs/{name}")
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool["function"]["name"]]},
                    "parameters": {"$ref": f"#/$defs/{name}"},
                },
                "required": ["name", "parameters"],
                # Nothing else in a call: a free extra key lets a model wander to max_tokens.
                "additionalProperties": False,
            }
        )
    most = {"maxItems": 1} if one else {}
    return {"type": "array", "minItems": 1, **most, "items": {"anyOf": calls}, "$defs": defs}


def structured_of(merged: Mapping[str, Any]) -> tuple[Structured | None, str, str | None]:
    """The answer's constraint, the tool mode and the named function of resolved params."""
    tools = merged.get("tools")
    choice = merged.get("tool_choice")
    if tools:
        if choice == "required":
            schema = tool_call_schema(tools, one=merged.get("parallel_tool_calls") is False)
            return Structured("json", _canonical(schema), schema), "required", None
        if isinstance(choice, Mapping):
            name = choice["function"]["name"]
            function = next(t["function"] for t in tools if t["function"]["name"] == name)
            schema = function.get("parameters") or {"type": "object"}
            return Structured("json", _canonical(schema), schema), "named", name
        if choice != "none":
            return None, "auto", None
    fmt = merged.get("response_format")
    if fmt is not None and fmt["type"] == "json_schema":
        # No schema given: an object, as OpenAI reads it. An empty one ({}) is any JSON value.
        schema = fmt["json_schema"].get("schema")
        if schema is None:
            schema = {"type": "object"}
        return Structured("json", _canonical(schema), schema), "none", None
    if fmt is not None and fmt["type"] == "json_object":
        return Structured("json_object", True), "none", None
    so = merged.get("structured_outputs")
    if so is not None:
        if "json" in so:
            return Structured("json", _canonical(so["json"]), so["json"]), "none", None
        if "json_object" in so:
            return Structured("json_object", True), "none", None
        kinds: tuple[StructuredKind, ...] = ("regex", "choice", "grammar")
        kind = next(k for k in kinds if k in so)
        return Structured(kind, so[kind]), "none", None
    return None, "none", None


def resolve_sampling(
    job_params: Mapping[str, Any] | None,
    item_params: Mapping[str, Any] | None,
    *,
    default_max_tokens: int,
    effort_budgets: Mapping[Any, int | None] = DEFAULT_EFFORT_BUDGETS,
) -> Sampling:
    merged = merge_layers(job_params, item_params, effort_budgets)
    thinking = bool(merged.get("enable_thinking", True))
    mode = _THINKING_DEFAULTS if thinking else _ANSWER_DEFAULTS
    stop = merged.get("stop")
    max_tokens = int(merged.get("max_tokens", default_max_tokens))
    budget = merged.get("thinking_budget") if thinking else None
    if budget is not None and merged.get("_effort") and budget >= max_tokens:
        budget = None  # an effort's budget that cannot bind: the item thinks up to max_tokens
    structured, tool_mode, tool_name = structured_of(merged)
    bias = merged.get("logit_bias")
    return Sampling(
        max_tokens=max_tokens,
        temperature=float(merged.get("temperature", mode["temperature"])),
        top_p=float(merged.get("top_p", mode["top_p"])),
        top_k=int(merged.get("top_k", mode["top_k"])),
        seed=merged.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        presence_penalty=float(merged.get("presence_penalty", 0.0)),
        frequency_penalty=float(merged.get("frequency_penalty", 0.0)),
        repetition_penalty=float(merged.get("repetition_penalty", 1.0)),
        enable_thinking=thinking,
        ignore_eos=bool(merged.get("ignore_eos", False)),
        thinking_budget=int(budget) if budget is not None else None,
        n=int(merged.get("n", 1)),
        min_p=float(merged.get("min_p", 0.0)),
        logit_bias={int(k): float(v) for k, v in bias.items()} if bias else None,
        stop_token_ids=tuple(merged.get("stop_token_ids") or ()),
        include_stop_str_in_output=bool(merged.get("include_stop_str_in_output", False)),
        logprobs=int(merged.get("top_logprobs", 0)) if merged.get("logprobs") else None,
        structured=structured,
        tools=merged.get("tools") if tool_mode != "none" else None,
        tool_mode=tool_mode,  # type: ignore[arg-type]
        tool_name=tool_name,
        one_tool_call=merged.get("parallel_tool_calls") is False,
    )
