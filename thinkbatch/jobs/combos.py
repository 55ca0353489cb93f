"""The checks on what one params object asks for together, and on what a job's params and an
item's make together, at submit.

Each layer is checked on its own (`check_params`): its groups replace the other layer's as a
whole (thinkbatch/sampling.py), so a valid group stays valid after the merge. What spans the
layers is kept in constant memory while the items stream, since a body may give the job's own
params after its items (`Combinations`): an item with a raw prompt that would inherit the job's
tools, and the bound on the log probabilities an item may return.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from thinkbatch.errors import InputError
from thinkbatch.jobs.asks import constraint_size
from thinkbatch.jobs.asks import regex_problem
from thinkbatch.jobs.asks import schema_problem
from thinkbatch.jobs.wire import ItemIn
from thinkbatch.jobs.wire import SamplingParamsIn
from thinkbatch.schema_refs import resolve
from thinkbatch.settings import Settings


def _bad(param: str, message: str, code: str = "invalid_value") -> InputError:
    return InputError(f"{param}: {message}", param=param, code=code)


def _uses_tools(params: SamplingParamsIn) -> bool:
    return bool(params.tools) and params.tool_choice != "none"


def check_params(params: SamplingParamsIn, prefix: str, settings: Settings) -> None:
    """What one params object asks for together (raises InputError naming the field)."""
    p = f"{prefix}." if prefix else ""
    if params.reasoning_effort is not None:
        for name in ("enable_thinking", "thinking_budget"):
            if getattr(params, name) is not None:
                raise _bad(f"{p}reasoning_effort", f"give reasoning_effort or {name}, not both")
    if params.n is not None and params.n > settings.max_choices:
        raise _bad(
            f"{p}n", f"{params.n} is above the limit of {settings.max_choices} (MAX_CHOICES)"
        )
    if (params.n or 1) > 1 and params.temperature == 0:
        raise _bad(f"{p}n", _GREEDY)
    if params.top_logprobs is not None and params.logprobs is not True:
        raise _bad(f"{p}top_logprobs", "needs logprobs: true")
    fmt = params.response_format
    constrained = fmt is not None and fmt.type != "text"
    if constrained and params.structured_outputs is not None:
        raise _bad(f"{p}structured_outputs", "give response_format or structured_outputs, not both")
    _check_tools(params, p, constrained or params.structured_outputs is not None)
    _check_schemas(params, p)
    size = constraint_size(params.overrides())
    if size > settings.max_grammar_chars:
        field = next(
            k for k in ("response_format", "structured_outputs", "tools") if getattr(params, k)
        )
        raise _bad(
            f"{p}{field}",
            f"{size} characters of answer constraints is more than the limit of "
            f"{settings.max_grammar_chars} (MAX_GRAMMAR_CHARS)",
            "grammar_too_large",
        )


# vLLM's rule: several choices of greedy decoding would all be the same one.
_GREEDY = "must be 1 with temperature 0 (greedy decoding makes every choice the same)"


def _check_tools(params: SamplingParamsIn, p: str, constrained: bool) -> None:
    choice = params.tool_choice
    if choice is not None and not params.tools:
        raise _bad(f"{p}tool_choice", "needs tools")
    if params.parallel_tool_calls is not None and not params.tools:
        raise _bad(f"{p}parallel_tool_calls", "needs tools")
    names: dict[str, int] = {}
    for i, tool in enumerate(params.tools or ()):
        first = names.setdefault(tool.function.name, i)
        if first != i:
            raise _bad(
                f"{p}tools[{i}].function.name",
                f"duplicate function name {tool.function.name!r} (first in tools[{first}])",
            )
    if choice is not None and not isinstance(choice, str) and choice.function.name not in names:
        raise _bad(
            f"{p}tool_choice.function.name",
            f"{choice.function.name!r} is not one of the tools ({', '.join(names)})",
        )
    if constrained and _uses_tools(params):
        raise _bad(
            f"{p}tools",
            "tools and a structured answer exclude each other (tool_choice 'none' allows both)",
        )


def _check_schemas(params: SamplingParamsIn, p: str) -> None:
    fmt = params.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        if why := schema_problem(fmt.json_schema.schema_):
            raise _bad(f"{p}response_format.json_schema.schema", why, "invalid_schema")
    so = params.structured_outputs
    if so is not None and so.json_ is not None and (why := schema_problem(so.json_)):
        raise _bad(f"{p}structured_outputs.json", why, "invalid_schema")
    if so is not None and so.regex is not None and (why := regex_problem(so.regex)):
        raise _bad(f"{p}structured_outputs.regex", why, "invalid_schema")
    for i, tool in enumerate(params.tools or ()):
        schema = tool.function.parameters
        if schema is not None and (why := schema_problem(schema)):
            raise _bad(f"{p}tools[{i}].function.parameters", why, "invalid_schema")
        if schema and _root_type(schema) != "object":
            # A call's arguments are a JSON object (OpenAI's rule too); `{}` or none means one
            # without fixed properties.
            raise _bad(
                f"{p}tools[{i}].function.parameters",
                f"must be a JSON Schema with type 'object' (a call's arguments are an object), "
                f"not type {_root_type(schema)!r}",
                "invalid_schema",
            )


def _root_type(schema: dict[str, Any]) -> Any:
    """A schema's type at its root, through root `$ref`s to its own definitions (the shape
    zod-to-json-schema writes: `{"$ref": "#/$defs/Args", "$defs": {...}}`), however many
    follow one another. The references were checked first (`schema_problem`): each pointer
    leads to a schema, and no loop of them stays off the value."""
    node: Any = schema
    seen: set[int] = set()
    while isinstance(node, dict) and "type" not in node and id(node) not in seen:
        seen.add(id(node))
        ref = node.get("$ref")
        if not (isinstance(ref, str) and ref.startswith("#/")):
            break
        node = resolve(schema, ref[1:])
    return node.get("type") if isinstance(node, dict) else None


# An item's params when it overrides none (`Combinations._plain` stands for it).
_NO_OVERRIDES = SamplingParamsIn()

# Which of (max_tokens, n, the logprobs group) an item sets.
_Pattern = tuple[bool, bool, bool]
_PLAIN: _Pattern = (False, False, False)  # an item that sets none of them


@dataclass(slots=True)
class _Worst:
    index: int
    product: int  # of the factors the item sets


class Combinations:
    """What spans a job's params and its items, in constant memory (see the module)."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._prompt_inheriting_tools: int | None = None  # first such item's index
        # First items that would meet the job's params in n > 1 with temperature 0.
        self._choices_without_temperature: int | None = None
        self._greedy_without_n: int | None = None
        self._worst: dict[_Pattern, _Worst] = {}

    def item(self, index: int, item: ItemIn) -> None:
        if item.params is None:
            self._plain(index, item)
            return
        check_params(item.params, f"items[{index}].params", self.settings)
        self._overriding(index, item, item.params)

    def _overriding(self, index: int, item: ItemIn, params: SamplingParamsIn) -> None:
        """Keep what `item`, overriding the job's `params` as it does, must be checked for
        once the job's own params are known."""
        sets_answer = any(
            getattr(params, k) is not None
            for k in ("response_format", "structured_outputs", "tools", "tool_choice")
        )
        if item.prompt is not None:
            if _uses_tools(params):
                raise _bad(
                    f"items[{index}].params.tools", "tools need messages (a chat), not a raw prompt"
                )
            if not sets_answer and self._prompt_inheriting_tools is None:
                self._prompt_inheriting_tools = index
        if (params.n or 1) > 1 and params.temperature is None:
            if self._choices_without_temperature is None:
                self._choices_without_temperature = index
        if params.temperature == 0 and params.n is None and self._greedy_without_n is None:
            self._greedy_without_n = index
        sets_logprobs = params.logprobs is not None or params.top_logprobs is not None
        if sets_logprobs and not params.logprobs:
            return  # logprobs off for this item, whatever the job says
        pattern = (params.max_tokens is not None, params.n is not None, sets_logprobs)
        product = (params.max_tokens or 1) * (params.n or 1) * ((params.top_logprobs or 0) + 1)
        worst = self._worst.get(pattern)
        if worst is None or product > worst.product:
            self._worst[pattern] = _Worst(index, product)

    def _plain(self, index: int, item: ItemIn) -> None:
        """`_overriding(index, item, _NO_OVERRIDES)` for an item that overrides no params
        (most items of most jobs), without reading each of its fields again: that reading was an
        eighth of the submit's CPU for a plain item."""
        if item.prompt is not None and self._prompt_inheriting_tools is None:
            self._prompt_inheriting_tools = index
        if _PLAIN not in self._worst:
            self._worst[_PLAIN] = _Worst(index, 1)

    def finish(self, job: SamplingParamsIn) -> None:
        """Check the kept items against the job's params (raises InputError)."""
        i = self._prompt_inheriting_tools
        if i is not None and _uses_tools(job):
            raise _bad(f"items[{i}].prompt", "the job's tools need messages (a chat), not a prompt")
        if (i := self._choices_without_temperature) is not None and job.temperature == 0:
            raise _bad(f"items[{i}].params.n", _GREEDY + " (params.temperature)")
        if (i := self._greedy_without_n) is not None and (job.n or 1) > 1:
            raise _bad(
                f"items[{i}].params.temperature",
                "must not be 0 with params.n > 1 (greedy decoding makes every choice the same)",
            )
        cap = self.settings.max_logprob_entries
        for (sets_max, sets_n, sets_lp), worst in sorted(
            self._worst.items(), key=lambda kv: kv[1].index
        ):
            if not sets_lp and not job.logprobs:
                continue
            product = worst.product
            if not sets_max:
                product *= job.max_tokens or self.settings.default_max_tokens
            if not sets_n:
                product *= job.n or 1
            if not sets_lp:
                product *= (job.top_logprobs or 0) + 1
            if product > cap:
                raise _bad(
                    f"items[{worst.index}].params.logprobs" if sets_lp else "params.logprobs",
                    f"max_tokens x n x (top_logprobs + 1) is {product} for items[{worst.index}], "
                    f"above the limit of {cap} (MAX_LOGPROB_ENTRIES)",
                    "logprobs_too_large",
                )
