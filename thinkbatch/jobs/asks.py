"""What a request may ask of the answer beyond sampling: a structured answer (OpenAI's
`response_format`, vLLM's `structured_outputs`), tools, and a reasoning effort. Wire models,
shared by native jobs and OpenAI lines, and the checks the API can make before anything runs.

A schema is checked against JSON Schema's meta-schema (the `jsonschema` library, the reference
validator, rather than a hand-written walk) and a regex by Python's `re`; what only the engine's
grammar compiler can refuse (a keyword xgrammar does not support, an EBNF grammar) fails that
item alone at the worker, as `grammar_error`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated
from typing import Any
from typing import Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import model_validator

from thinkbatch.bools import OnlyTrue
from thinkbatch.limits import TOOLS_MAX
from thinkbatch.sampling import tool_call_schema
from thinkbatch.schema_refs import ref_problem
from thinkbatch.schema_refs import unheld_problem

_INPUT = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`, as OpenAI defines it."""

    model_config = _INPUT
    name: FunctionName
    description: str | None = None
    # `schema` shadows a BaseModel attribute, so the field is renamed and keeps its wire name.
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = Field(
        None, description="Accepted; the answer is always held to the schema by the grammar."
    )


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: `text`, `json_object` or `json_schema`."""

    model_config = _INPUT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the answer."""

    model_config = _INPUT
    json_: dict[str, Any] | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1, description="An EBNF (GBNF) grammar.")
    json_object: OnlyTrue | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(
            self, k) is not None]  # fmt: skip
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self


class FunctionDef(BaseModel):
    model_config = _INPUT
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _INPUT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _INPUT
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = _INPUT
    type: Literal["function"]
    function: NamedFunction


Tools = Annotated[list[Tool], Field(min_length=1, max_length=TOOLS_MAX)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high"]


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` is not a valid JSON Schema (against the meta-schema of the draft it names,
    2020-12 when it names none), or has references the engine and the worker cannot follow
    safely (thinkbatch/schema_refs.py), or None."""
    if not isinstance(schema.get("$schema", ""), str):
        # jsonschema reads the draft's URI from `$schema` before any check of its own: a
        # number, a list or a bool there raises TypeError or AttributeError, not SchemaError.
        return "not a valid JSON Schema: $schema must be a string (the URI of a draft)"
    try:
        validator_for(schema, default=validator_for({})).check_schema(schema)
    except SchemaError as error:
        where = "/".join(str(p) for p in error.relative_path)
        return f"not a valid JSON Schema{' at ' + where if where else ''}: {error.message}"
    except RecursionError:  # bounded by MAX_JSON_DEPTH long before; kept as a 400 regardless
        return "not a valid JSON Schema: nested too deep"
    return ref_problem(schema) or unheld_problem(schema)


def regex_problem(pattern: str) -> str | None:
    try:
        re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as error:
        return f"not a valid regular expression: {error}"
    return None


def constraint_size(params: dict[str, Any]) -> int:
    """Characters of the answer constraints in `params` (schema, regex, grammar, choices, tool
    schemas) as the engine's grammar compiler is handed them: a regex or a grammar as its own
    text, a schema or a list as compact JSON, the tools as sent or, for tool_choice
    `required`, as the calls' schema built of them where that is larger. Counted as JSON
    text, a regex's every backslash was two characters and a grammar's every line break two:
    a 44,000-character regex was refused as 66,013."""
    size = 0
    for key in ("response_format", "structured_outputs", "tools"):
        value = params.get(key)
        if isinstance(value, dict):
            size += sum(_handed_chars(v) for v in value.values())
        elif value is not None:
            size += _handed_chars(value)
    tools = params.get("tools")
    if tools and params.get("tool_choice") == "required":
        # The engine is handed a schema of the calls (sampling.py), each tool's parameters
        # wrapped in its call's object: larger than the tools as sent where they carry little
        # description, and what the grammar compiler then compiles.
        calls = tool_call_schema(tools, one=params.get("parallel_tool_calls") is False)
        size += max(0, _handed_chars(calls) - _handed_chars(tools))
    return size


def _handed_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
