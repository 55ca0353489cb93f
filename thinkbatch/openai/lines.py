"""Lines of the OpenAI Batch format: an input line read into an item, an item rendered as an
output or error line.

Input: `{custom_id, method:"POST", url, body}`, where `body` is a chat completion request
(`/v1/chat/completions`) or a completion request with one `prompt` string (`/v1/completions`).
Only what the engine honours is accepted; any other body field is a line error naming it
(`body.<name>`), never silently dropped. Sampling values are checked by `SamplingParamsIn`, the
same model (and the same bounds table) as native jobs.

Output lines follow vLLM's `run_batch` (`BatchRequestOutput`): `{id, custom_id, response:
{status_code, request_id, body}, error}`; the chat message carries the thinking as `reasoning`
(vLLM's current field) and as `reasoning_content` (its older name, which some clients still
read). Every line is a pure function of stored rows, so a file streams to the same bytes every
time and its size, computed once, stays exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationError

from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import read_object
from thinkbatch.jobs import ItemIn
from thinkbatch.jobs import Message
from thinkbatch.jobs import ResultRow
from thinkbatch.jobs import SamplingParamsIn

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

_IN = ConfigDict(extra="forbid", strict=True)
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


class _TextPart(BaseModel):
    model_config = _IN
    type: Literal["text"]
    text: str


class _ChatMessage(BaseModel):
    model_config = _IN
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart]


class _TemplateKwargs(BaseModel):
    model_config = _IN
    enable_thinking: bool | None = None


class _Body(BaseModel):
    """What both endpoints take; sampling values are typed loosely here and checked by
    SamplingParamsIn, so their bounds live in one place."""

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
    n: Literal[1] | None = None
    stream: Literal[False] | None = None


class _ChatBody(_Body):
    messages: list[_ChatMessage] = Field(min_length=1)
    max_completion_tokens: Any = None
    chat_template_kwargs: _TemplateKwargs | None = None


class _CompletionBody(_Body):
    prompt: str = Field(min_length=1)


class _Line(BaseModel):
    model_config = _IN
    custom_id: str = Field(min_length=1, max_length=128)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def _param(loc: tuple[int | str, ...], prefix: str) -> str:
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out = f"{out}.{part}" if out else str(part)
    return out


def _from_validation(
    error: ValidationError, prefix: str, rename: dict[str, str] | None = None
) -> InputError:
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    # A union (content: str | parts) reports each branch; name the field, not the branch.
    loc = tuple(p for p in loc if p not in ("str", "list[_TextPart]"))
    if rename and loc and loc[0] in rename:
        loc = (rename[str(loc[0])], *loc[1:])
    param = _param(loc, prefix)
    kind = first["type"]
    message = first["msg"]
    if kind == "extra_forbidden":
        message = "unknown field: not supported by this server"
    elif kind == "missing":
        message = "Field required"
    return InputError(f"{param}: {message}", param=param)


@dataclass(frozen=True, slots=True)
class ParsedLine:
    custom_id: str
    model: str
    item: ItemIn
    max_tokens_param: str  # which body field set max_tokens, for messages about it


def parse_line(raw: bytes, endpoint: str, limits: Limits) -> ParsedLine:
    """One input line as an item, or an InputError naming the field. The line is read under the
    same guards as a job body (thinkbatch/guard.py): strict UTF-8, no NUL or lone surrogate,
    no duplicate key, bounded depth, numbers in range, and the item limits over the line."""
    try:
        data = read_object(raw, limits)
    except InputError as error:
        message = error.message.replace("request body", "the line", 1)
        raise InputError(message, param=error.param, code=error.code) from None
    try:
        line = _Line.model_validate(data)
    except ValidationError as error:
        raise _from_validation(error, "") from None
    if line.url != endpoint:
        raise InputError(
            f"url: {line.url!r} differs from the batch's endpoint {endpoint!r}",
            param="url",
            code="invalid_url",
        )
    body_model = _ChatBody if endpoint == CHAT else _CompletionBody
    try:
        body = body_model.model_validate(line.body)
    except ValidationError as error:
        raise _from_validation(error, "body") from None
    sampling: dict[str, Any] = {
        name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None
    }
    max_param = "body.max_tokens"
    if isinstance(body, _ChatBody) and body.max_completion_tokens is not None:
        if body.max_tokens is not None:
            raise InputError(
                "body.max_tokens: give max_completion_tokens or max_tokens, not both",
                param="body.max_tokens",
            )
        sampling["max_tokens"] = body.max_completion_tokens
        max_param = "body.max_completion_tokens"
    elif body.max_tokens is not None:
        sampling["max_tokens"] = body.max_tokens
    if isinstance(body, _ChatBody) and body.chat_template_kwargs is not None:
        if body.chat_template_kwargs.enable_thinking is not None:
            sampling["enable_thinking"] = body.chat_template_kwargs.enable_thinking
    try:
        params = SamplingParamsIn.model_validate(sampling)
    except ValidationError as error:
        raise _from_validation(error, "body", {"max_tokens": max_param[5:]}) from None
    if isinstance(body, _ChatBody):
        messages = [
            Message(
                role="system" if m.role == "developer" else m.role,
                content=m.content
                if isinstance(m.content, str)
                else "\n".join(part.text for part in m.content),
            )
            for m in body.messages
        ]
        item = ItemIn(custom_id=line.custom_id, messages=messages, params=params)
    else:
        item = ItemIn(custom_id=line.custom_id, prompt=body.prompt, params=params)
    return ParsedLine(line.custom_id, body.model, item, max_param)


# --- output -----------------------------------------------------------------------------------

# Item errors the caller can fix (the request itself is at fault) answer 400, others 500.
_CLIENT_ERRORS = {"prompt_too_long", "invalid_request", "template_error", "max_tokens_too_large"}
_OPENAI_CODES = {"prompt_too_long": "context_length_exceeded"}
_FINISH = {"stop", "length"}


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
            "param": None,
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
    finish = row.finish_reason if row.finish_reason in _FINISH else "stop"
    reasoning = row.thinking or None  # thinking off: no reasoning at all, not ""
    if endpoint == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": row.answer or "",
                "reasoning": reasoning,
                "reasoning_content": reasoning,
            },
            "logprobs": None,
            "finish_reason": finish,
            "thinking_truncated": bool(row.thinking_truncated),
        }
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {
            "index": 0,
            "text": row.answer or "",
            "reasoning": reasoning,
            "logprobs": None,
            "finish_reason": finish,
            "thinking_truncated": bool(row.thinking_truncated),
        }
        kind, prefix = "text_completion", "cmpl"
    return {
        "id": f"{prefix}-{row.item_id:024x}",
        "object": kind,
        "created": int(row.finished_at.timestamp()) if row.finished_at else 0,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }
