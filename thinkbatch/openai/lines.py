"""Lines of the OpenAI Batch format: an input line read into an item, an item rendered as an
output or error line.

Input: `{custom_id, method:"POST", url, body}`, where `body` is a chat completion request
(`/v1/chat/completions`) or a completion request with one `prompt` string (`/v1/completions`).
The body takes the fields OpenAI and vLLM define for what the engine does (docs/openai.md lists
them); a field neither defines, or one this server does not do, is refused naming it, never
silently dropped. Values are checked by `SamplingParamsIn` and the job service's checks, the same
models (and the same bounds table) as native jobs.

As OpenAI does, faults are of two kinds. A line that cannot be read as a request of this batch
(not JSON, no custom_id, the wrong url or method, a line the guard refuses) is a fault of the
file: `parse_line` raises, and the batch fails at validation. A readable line whose request body
is at fault (an unknown field, a bad value, fields that exclude each other) is a fault of that
request alone: the line becomes a `RefusedItem`, stored failed, answered in the error file as
OpenAI answers a bad request (a 400 with `param` naming the body's field, `temperature` or
`messages[0].role`, without the `body.` prefix), while the rest of the batch runs.

Output lines follow vLLM's `run_batch` (`BatchRequestOutput`): `{id, custom_id, response:
{status_code, request_id, body}, error}`; the chat message carries the thinking as `reasoning`
(vLLM's current field) and as `reasoning_content` (its older name, which some clients still
read). Every line is a pure function of stored rows, so a file streams to the same bytes every
time and its size, computed once, stays exact.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Annotated
from typing import Any
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError

from thinkbatch.bools import OnlyFalse
from thinkbatch.errors import REJECTION_CODES
from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import read_object
from thinkbatch.guard import validation_error
from thinkbatch.jobs import ItemIn
from thinkbatch.jobs import Message
from thinkbatch.jobs import RefusedItem
from thinkbatch.jobs import ResultRow
from thinkbatch.jobs import SamplingParamsIn

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

_IN = ConfigDict(extra="forbid", strict=True)
# Body fields handed to SamplingParamsIn under the same name (typed loosely in the body models,
# so that their bounds live in one place).
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "min_p",
    "logit_bias",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "response_format",
    "structured_outputs",
    "reasoning_effort",
)
_CHAT_SAMPLING = ("logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls")
# Chat fields a completion request cannot take: tools are rendered by the chat template.
_CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls")


class _TextPart(BaseModel):
    model_config = _IN
    type: Literal["text"]
    text: str


class _ChatMessage(BaseModel):
    """A message as OpenAI writes it; `Message` (the job service's) then checks its shape."""

    model_config = _IN
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[_TextPart] | None = None
    name: str | None = Field(None, description="Accepted; the chat template does not use it.")
    tool_calls: Any = None
    tool_call_id: Any = None
    # What an earlier completion's assistant message carries when a batch echoes it back.
    refusal: str | None = Field(None, description="Accepted; the chat template does not use it.")


class _TemplateKwargs(BaseModel):
    model_config = _IN
    enable_thinking: bool | None = None


MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class _Body(BaseModel):
    """What both endpoints take. Sampling values are typed loosely here and checked by
    SamplingParamsIn. `user`, `safety_identifier`, `prompt_cache_key`, `metadata`, `store`
    and `service_tier` are accepted as OpenAI types them and have no effect here
    (docs/openai.md)."""

    model_config = _IN
    model: str = Field(min_length=1)
    max_tokens: Any = None
    temperature: Any = None
    top_p: Any = None
    top_k: Any = None
    seed: Any = None
    stop: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    n: Any = None
    min_p: Any = None
    logit_bias: Any = None
    stop_token_ids: Any = None
    include_stop_str_in_output: Any = None
    ignore_eos: Any = None
    logprobs: Any = None
    response_format: Any = None
    structured_outputs: Any = None
    reasoning_effort: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    stream: OnlyFalse | None = None
    stream_options: None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None


class _ChatBody(_Body):
    messages: list[_ChatMessage] = Field(min_length=1)
    max_completion_tokens: Any = None
    top_logprobs: Any = None
    chat_template_kwargs: _TemplateKwargs | None = None


class _CompletionBody(_Body):
    prompt: str = Field(min_length=1)


class _Line(BaseModel):
    model_config = _IN
    custom_id: str = Field(min_length=1, max_length=128)
    method: Literal["POST"]
    url: str
    body: Any


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """A line of the file: its request as an item, or refused for its body. `model` is what
    the body names (None if it names none); `renames` turn the job service's names for an
    item's fields into the body's (`max_tokens` set by `max_completion_tokens`, a completion's
    `top_logprobs` set by its `logprobs`)."""

    custom_id: str
    model: str | None
    item: ItemIn | RefusedItem
    renames: dict[str, str]


# What an error's pydantic or job-service code is in OpenAI's vocabulary for a bad request.
_PYDANTIC_CODES = {
    "extra_forbidden": "unknown_parameter",
    "missing": "missing_required_parameter",
}
# Codes of the job service's checks kept as they are: they say more than `invalid_value`.
_KEPT_CODES = frozenset(
    {
        "max_tokens_too_large",
        "prompt_too_large",
        "prompt_too_long",
        "invalid_schema",
        "grammar_too_large",
        "logprobs_too_large",
        "too_many_messages",
    }
)
# Every code a line refused for its body may carry (`openai_code`): rendered as a 400.
REQUEST_CODES = frozenset(
    {"unknown_parameter", "missing_required_parameter", "invalid_type", "invalid_value"}
    | _KEPT_CODES
)


def openai_code(code: str) -> str:
    if code in _PYDANTIC_CODES:
        return _PYDANTIC_CODES[code]
    if code in _KEPT_CODES:
        return code
    if code.endswith(("_type", "_parsing")):
        return "invalid_type"
    return "invalid_value"


def request_param(param: str | None, renames: dict[str, str] | None = None) -> str | None:
    """A body field's name as OpenAI's error `param` gives it: the request's own field path,
    without `body.` (`temperature`, `messages[0].role`), after `renames`."""
    if param is None or param == "body":
        return None
    name = param.removeprefix("body.")
    for old, new in (renames or {}).items():
        if name == old or name.startswith((f"{old}.", f"{old}[")):
            return new + name[len(old) :]
    return name


def refusal(
    custom_id: str,
    error: InputError,
    renames: dict[str, str] | None = None,
    model: str | None = None,
) -> RefusedItem:
    """A bad request body as the refused item that stands for its line (`model`: what its body
    names). The message starts with the field as OpenAI names it, like the param."""
    param = request_param(error.param, renames)
    message = error.message
    if error.param is not None and message.startswith(f"{error.param}: "):
        message = message[len(error.param) + 2 :]
    if param is not None:
        message = f"{param}: {message}"
    elif message.startswith("body: "):
        message = message[len("body: ") :]
    if error.code == "extra_forbidden":
        message = f"{param}: unknown parameter: not supported by this server"
    return RefusedItem(custom_id, openai_code(error.code), message, param, model)


def parse_line(raw: bytes, endpoint: str, limits: Limits) -> ParsedLine:
    """One input line as an item or a refused item, or an InputError naming what makes the line
    unreadable (a fault of the file). The line is read under the same guards as a job body
    (thinkbatch/guard.py): strict UTF-8, no NUL or lone surrogate, no duplicate key, bounded
    depth, numbers in range, and the item limits over the line; a line they refuse cannot be
    read far enough to know its custom_id, so it is a fault of the file too."""
    try:
        data = read_object(raw, limits)
    except InputError as error:
        message = error.message.replace("request body", "the line", 1)
        raise InputError(message, param=error.param, code=error.code) from None
    try:
        line = _Line.model_validate(data)
    except ValidationError as error:
        found = validation_error(error, data=data)
        if found.code == "extra_forbidden":
            found = InputError(
                f"{found.param}: unknown field: a line has custom_id, method, url and body",
                param=found.param,
                code="unknown_field",
            )
        raise found from None
    if line.url != endpoint:
        raise InputError(
            f"url: {line.url!r} differs from the batch's endpoint {endpoint!r}",
            param="url",
            code="invalid_url",
        )
    body = line.body
    model = body.get("model") if isinstance(body, dict) else None
    renames: dict[str, str] = {}
    try:
        item = _item(line.custom_id, body, endpoint, renames)
    except InputError as error:
        named = model if isinstance(model, str) else None
        return ParsedLine(
            line.custom_id, named, refusal(line.custom_id, error, renames, named), renames
        )
    return ParsedLine(line.custom_id, model, item, renames)


def _bad(param: str, message: str, code: str = "invalid_value") -> InputError:
    return InputError(f"{param}: {message}", param=param, code=code)


def _item(custom_id: str, data: Any, endpoint: str, renames: dict[str, str]) -> ItemIn:
    """The body as an item, or an InputError naming the body's field (`body.<name>`).
    `renames` is filled as the body's fields are read."""
    if not isinstance(data, dict):
        raise InputError("body: must be a JSON object (the request)", param="body")
    if data.get("stream") is not None and data.get("stream") is not False:  # 0 is not false
        raise _bad("body.stream", "a batch's requests do not stream: false or absent")
    if data.get("stream_options") is not None:
        raise _bad("body.stream_options", "needs stream: true, which a batch's requests are not")
    chat = endpoint == CHAT
    if not chat:
        for name in _CHAT_ONLY:
            if data.get(name) is not None:
                raise _bad(f"body.{name}", f"tools need {CHAT}")
    try:
        body = (_ChatBody if chat else _CompletionBody).model_validate(data)
    except ValidationError as error:
        raise validation_error(error, "body", data) from None
    sampling: dict[str, Any] = {
        name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None
    }
    if isinstance(body, _ChatBody):
        sampling |= {k: getattr(body, k) for k in _CHAT_SAMPLING if getattr(body, k) is not None}
        if body.max_completion_tokens is not None:
            if body.max_tokens is not None:
                raise _bad("body.max_tokens", "give max_completion_tokens or max_tokens, not both")
            sampling["max_tokens"] = body.max_completion_tokens
            renames["max_tokens"] = "max_completion_tokens"
        if body.chat_template_kwargs is not None:
            if body.chat_template_kwargs.enable_thinking is not None:
                sampling["enable_thinking"] = body.chat_template_kwargs.enable_thinking
                renames["enable_thinking"] = "chat_template_kwargs.enable_thinking"
    elif body.logprobs is not None:
        # The legacy `logprobs` is how many alternatives to return per token (0: the sampled
        # token's alone): logprobs on, with that many top_logprobs, bounded as those are.
        if not isinstance(body.logprobs, int) or isinstance(body.logprobs, bool):
            raise _bad("body.logprobs", "must be an integer, the top log probabilities per "
                       "token", "int_type")  # fmt: skip
        sampling["logprobs"] = True
        sampling["top_logprobs"] = body.logprobs
        renames["top_logprobs"] = "logprobs"
    if body.max_tokens is not None:
        sampling["max_tokens"] = body.max_tokens
    try:
        params = SamplingParamsIn.model_validate(sampling)
    except ValidationError as error:
        raise _renamed(validation_error(error, "body", sampling), renames) from None
    if isinstance(body, _ChatBody):
        messages = [_message(i, m) for i, m in enumerate(body.messages)]
        return ItemIn(custom_id=custom_id, messages=messages, params=params)
    return ItemIn(custom_id=custom_id, prompt=body.prompt, params=params)


def _renamed(error: InputError, renames: dict[str, str]) -> InputError:
    for old, new in renames.items():
        renamed = error.renamed(f"body.{old}", f"body.{new}")
        if renamed is not error:
            return renamed
    return error


def _message(index: int, m: _ChatMessage) -> Message:
    raw: dict[str, Any] = {
        "role": "system" if m.role == "developer" else m.role,
        "content": m.content
        if not isinstance(m.content, list)
        else "\n".join(part.text for part in m.content),
    }
    for key in ("tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            raw[key] = getattr(m, key)
    try:
        return Message.model_validate(raw)
    except ValidationError as error:
        raise validation_error(error, f"body.messages[{index}]", raw) from None


# --- output -----------------------------------------------------------------------------------

# Item errors the caller can fix (the request itself is at fault) answer 400, others 500: the
# engine's refusals of a request (a 500 would have SDKs retry what cannot run), and every code
# a refused line carries.
_CLIENT_ERRORS = REJECTION_CODES | REQUEST_CODES
_OPENAI_CODES = {"prompt_too_long": "context_length_exceeded"}
_FINISH = {CHAT: ("stop", "length", "tool_calls"), COMPLETIONS: ("stop", "length")}
# The processing tier a chat completion says it was served at (OpenAI's `service_tier` in a
# response names the tier actually used, whatever the request asked): there is only one here.
SERVICE_TIER = "default"


def _dump(line: dict[str, Any]) -> bytes:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"


def render(row: ResultRow, *, endpoint: str, model: str) -> bytes:
    """The output (succeeded) or error (otherwise) line of one item."""
    line_id = f"batch_req_{row.item_id:024x}"
    if row.status == "succeeded":
        response = {
            "status_code": 200,
            "request_id": f"req_{row.item_id:024x}",
            "body": _completion(row, endpoint, model),
        }
        return _dump({"id": line_id, "custom_id": row.custom_id, "response": response,
                      "error": None})  # fmt: skip
    if row.status in ("cancelled", "expired"):
        code = "batch_cancelled" if row.status == "cancelled" else "batch_expired"
        message = row.error_message or f"the batch was {row.status} before this request ran"
        return _dump({"id": line_id, "custom_id": row.custom_id, "response": None,
                      "error": {"code": code, "message": message}})  # fmt: skip
    code = row.error_code or "server_error"
    client = code in _CLIENT_ERRORS
    body = {
        "error": {
            "message": row.error_message or code,
            "type": "invalid_request_error" if client else "server_error",
            "param": row.error_param,
            "code": _OPENAI_CODES.get(code, code),
        }
    }
    response = {
        "status_code": 400 if client else 500,
        "request_id": f"req_{row.item_id:024x}",
        "body": body,
    }
    return _dump({"id": line_id, "custom_id": row.custom_id, "response": response, "error": None})


def _completion(row: ResultRow, endpoint: str, model: str) -> dict[str, Any]:
    prompt = row.prompt_tokens or 0
    completion = row.completion_tokens or 0
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "completion_tokens_details": {"reasoning_tokens": row.reasoning_tokens or 0},
    }
    chat = endpoint == CHAT
    choices = [
        (_chat_choice if chat else _text_choice)(i, record, _FINISH[endpoint])
        for i, record in enumerate(row.all_choices())
    ]
    out: dict[str, Any] = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{row.item_id:024x}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(row.finished_at.timestamp()) if row.finished_at else 0,
        "model": model,
        "choices": choices,
        "usage": usage,
    }
    if chat:
        out["service_tier"] = SERVICE_TIER
    return out


def _chat_choice(index: int, record: dict[str, Any], finishes: tuple[str, ...]) -> dict[str, Any]:
    reasoning = record.get("thinking") or None  # thinking off: no reasoning at all, not ""
    calls = record.get("tool_calls")
    answer = record.get("answer") or ""
    message: dict[str, Any] = {
        "role": "assistant",
        # With tool calls and nothing besides, no content (null), as OpenAI's message has.
        "content": None if calls and not answer else answer,
        "reasoning": reasoning,
        "reasoning_content": reasoning,
    }
    if calls:
        message["tool_calls"] = calls
    entries = record.get("logprobs")
    return {
        "index": index,
        "message": message,
        "logprobs": (
            {"content": [_token(e) for e in entries], "refusal": None}
            if entries is not None
            else None
        ),
        "finish_reason": _finish(record, finishes),
        "thinking_truncated": bool(record.get("thinking_truncated")),
    }


def _text_choice(index: int, record: dict[str, Any], finishes: tuple[str, ...]) -> dict[str, Any]:
    entries = record.get("logprobs")
    return {
        "index": index,
        "text": record.get("answer") or "",
        "reasoning": record.get("thinking") or None,
        "logprobs": _legacy_logprobs(entries) if entries is not None else None,
        "finish_reason": _finish(record, finishes),
        "thinking_truncated": bool(record.get("thinking_truncated")),
    }


def _finish(record: dict[str, Any], finishes: tuple[str, ...]) -> str:
    reason = record.get("finish_reason")
    return reason if reason in finishes else "stop"


def _token(entry: dict[str, Any]) -> dict[str, Any]:
    """A token's log probability in OpenAI's chat shape (every key present)."""
    return {
        "token": entry["token"],
        "logprob": entry["logprob"],
        "bytes": entry.get("bytes"),
        "top_logprobs": [
            {"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes")}
            for t in entry.get("top_logprobs") or ()
        ],
    }


def _legacy_logprobs(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The completions API's own shape: parallel lists, each position's alternatives as a
    token -> logprob object (the sampled token first, as vLLM writes it), and each token's
    offset in the text: in characters, from the tokens' bytes, so that a token inside a
    multi-byte character (spelled `bytes:\\x..`) sits at that character's offset."""
    offsets: list[int] = []
    chars = codecs.getincrementaldecoder("utf-8")("replace")  # holds a character's first bytes
    at = 0
    for entry in entries:
        offsets.append(at)
        raw = entry.get("bytes")
        at += len(chars.decode(bytes(raw) if raw is not None else entry["token"].encode()))
    tops: list[dict[str, float]] = []
    for entry in entries:
        top = {entry["token"]: entry["logprob"]}
        for t in entry.get("top_logprobs") or ():
            top.setdefault(t["token"], t["logprob"])
        tops.append(top)
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
