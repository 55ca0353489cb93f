"""What an answer holds beyond its text: the JSON a structured answer must be, and the tool calls
a tool-using answer makes. The worker applies these before it stores a result, so that what is
stored is what the request was promised; readers only render it.

Tool calls are read the way vLLM's Hermes parser reads Qwen3's (`<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks, the content being what lies outside them); with
`tool_choice` `required` the answer is the JSON array of calls the grammar forced, and with a
named function it is that function's arguments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import referencing
import referencing.exceptions
from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError
from jsonschema.validators import validator_for

from thinkbatch.sampling import Sampling

_LOCAL: referencing.Registry[Any] = referencing.Registry()
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class AnswerInvalid(Exception):
    """The answer is not what its constraint promised (the grammar was cut short, or the
    engine ran without one)."""


@dataclass(slots=True)
class Parsed:
    content: str
    tool_calls: list[dict[str, Any]] | None = None
    is_json: bool = False


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """`arguments` is JSON text, always: OpenAI's `arguments` is a string that parses."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _dumped(value: Any) -> str:
    # A parsed value, as vLLM's parsers write it: a model that wrote `"arguments": "x"` gets
    # the JSON string "\"x\"", never the bare text x that no client could parse.
    return json.dumps(value, ensure_ascii=False)


def _json(answer: str, schema: dict[str, Any] | None) -> Any:
    try:
        value = json.loads(answer)
    except ValueError as error:
        raise AnswerInvalid(f"the answer is not JSON: {error}") from None
    if schema is not None:
        # An empty registry: a reference outside the schema is never fetched (the submit
        # refuses those; this holds for anything stored before it did).
        validator = validator_for(schema, default=Draft202012Validator)(schema, registry=_LOCAL)
        try:
            validator.validate(value)
        except ValidationError as error:
            raise AnswerInvalid(f"the answer does not match its schema: {error.message}") from None
        except (RecursionError, referencing.exceptions.Unresolvable) as error:
            # A loop or a dangling reference the submit did not see (stored before it checked):
            # this item's fault, never its batch-mates'.
            raise AnswerInvalid(
                f"the answer could not be checked against its schema: {type(error).__name__}"
            ) from None
    return value


def parse_answer(answer: str, sampling: Sampling, call_prefix: str) -> Parsed:
    """The answer as stored: checked against its JSON constraint, tool calls taken out.
    `call_prefix` makes tool call ids unique and stable (the item and choice)."""
    mode = sampling.tool_mode
    structured = sampling.structured
    if mode == "named":
        assert structured is not None and sampling.tool_name is not None
        _json(answer, structured.schema)
        return Parsed("", [_call(f"{call_prefix}_0", sampling.tool_name, answer)])
    if mode == "required":
        assert structured is not None
        calls = _json(answer, structured.schema)
        return Parsed(
            "",
            [
                _call(f"{call_prefix}_{i}", c["name"], _dumped(c["parameters"]))
                for i, c in enumerate(calls)
            ],
        )
    if mode == "auto":
        return _hermes(answer, sampling, call_prefix)
    if structured is not None and structured.json_answer:
        value = _json(answer, structured.schema)
        if structured.kind == "json_object" and not isinstance(value, dict):
            raise AnswerInvalid("the answer is JSON but not an object")
        return Parsed(answer, is_json=True)
    return Parsed(answer)


def _hermes(answer: str, sampling: Sampling, call_prefix: str) -> Parsed:
    """Tool calls in Qwen3's format. A block that does not parse, or names no known function,
    is left in the content, as vLLM's parser leaves it."""
    known = {t["function"]["name"] for t in sampling.tools or ()}
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(answer):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if name not in known:
            continue
        kept.append(answer[last : match.start()])
        last = match.end()
        calls.append(_call(f"{call_prefix}_{len(calls)}", name, _dumped(arguments)))
    if not calls:
        return Parsed(answer)
    kept.append(answer[last:])
    # parallel_tool_calls false: the first call, as vLLM's server keeps it; the others' blocks
    # are calls still, and stay out of the content.
    return Parsed("".join(kept).strip(), calls[:1] if sampling.one_tool_call else calls)
