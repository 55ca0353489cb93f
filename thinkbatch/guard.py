"""The one guard on untrusted text and JSON: every request body, batch-file line and batch
create body is read here, and every other text a caller sends (query values, form fields,
filenames) is checked by `check_text`.

A job body is read as a stream: its items come out one by one, to be validated and copied into
Postgres, so the API's memory stays flat however large the job (a whole-body parse of a
100k-item job costs hundreds of MB per request). Errors name the field
(`items[3].messages[0].role`).

Hostile input is refused here, in bounded time and memory, before anything is built:

- nesting deeper than `max_depth` (counted on the parser's events: ijson's `parse` keeps a
  prefix string per level, whose memory grows with the square of the depth, so only
  `basic_parse` is used and the path is tracked here);
- duplicate keys at any level, NUL in any string (PostgreSQL text and jsonb cannot hold it);
- bytes that are not strict UTF-8 (CESU-8, encoded surrogates) and `\\uD800`-style escapes
  that are not a proper surrogate pair: yajl would store a lone high surrogate as `?` and fail
  on the rest, so the raw bytes are checked before the parser sees them (`guard_events.Guard`);
- anything after the top-level object;
- numbers the parser cannot hold (Python's own parser raises ValueError past 4,300 digits);
- an item (or a whole line) past the item limits (`Limits`), counted on the events.

Invalid JSON gets one line with the byte offset and never an echo of the body.

Two readers do this: the exact one (thinkbatch/guard_events.py) makes each check on the parser's
event that decides it; the fast one (thinkbatch/guard_fast.py) decodes a whole item at a time in
C and hands the rest of the body to the exact one wherever it is not certain of the answer, so
that every refusal is the exact reader's. A plain item costs about half as much CPU through the
fast one (tests/unit/test_guard_fast.py holds the two to the same answers).
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from typing import IO
from typing import Any

from pydantic import ValidationError

from thinkbatch import guard_fast
from thinkbatch.errors import InputError
from thinkbatch.guard_events import MAX_SHOWN_KEY
from thinkbatch.guard_events import Limits
from thinkbatch.guard_events import bad
from thinkbatch.guard_events import path_at
from thinkbatch.guard_events import read_events

__all__ = ["Limits", "check_text", "read_body", "read_object", "validation_error"]


# The whitespace of JSON, which a blank body or a blank line of a batch file may hold. Python's
# strip() also takes a vertical tab, a form feed and others for whitespace; JSON does not, and
# a body of one form feed is invalid, not empty.
JSON_WHITESPACE = b" \t\n\r"


def is_blank(raw: bytes) -> bool:
    """Whether `raw` holds nothing but JSON's whitespace."""
    return not raw.strip(JSON_WHITESPACE)


def check_text(value: str, param: str) -> str:
    """A caller's text as PostgreSQL can store it: no NUL (text and jsonb cannot hold one),
    and no lone UTF-16 surrogate (not a character; JSON escapes and form decoding can make
    one). Returns the value."""
    if "\x00" in value:
        raise InputError(f"{param}: must not contain NUL (\\u0000)", param=param)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InputError(
            f"{param}: holds a lone UTF-16 surrogate, not a character", param=param
        ) from None
    return value


def read_body(stream: IO[bytes], limits: Limits) -> Iterator[tuple[str, Any]]:
    """Yield ("items", None) where the items array (`limits.items_key`) starts, ("item",
    value) for each of its elements and ("field", (key, value)) for every other top-level key,
    in body order, or raise the InputError that names the first fault.

    Read by Python's JSON decoder, one item at a time (thinkbatch/guard_fast.py), and by the
    event loop (`read_events`) from wherever the decoder is not certain of the answer."""
    return guard_fast.read_body(stream, limits)


def read_object(data: bytes, limits: Limits) -> dict[str, Any]:
    """A whole JSON object (a batch file's line, a batch's create body) read under the same
    guards as a job body, its counts over the whole object. Held whole, it can be read again:
    a fault of its bytes (bad UTF-8, a lone surrogate) is named by the field it is in."""
    whole = Limits(
        max_depth=limits.max_depth,
        max_messages=limits.max_messages,
        max_chars=limits.max_chars,
        max_values=limits.max_values,
        items_key=None,
    )
    fast = guard_fast.read_whole(data, whole)
    if fast is not None:
        return fast
    try:
        return {key: value for _, (key, value) in read_events(io.BytesIO(data), whole)}
    except InputError as error:
        offset = getattr(error, "offset", None)
        if error.param is not None or offset is None:
            raise
        path = path_at(data[:offset], whole.max_depth)
        if not path:
            raise
        reason = error.message.removeprefix("request body: ")
        raise InputError(f"{path}: {reason}", param=path, code=error.code) from None


_NO_INPUT: Any = object()
# The tags pydantic gives union branches in an error's location: a type's name (`str`,
# `list[str]`, `literal['a','b']`, `function-after[...]`) or a model's class name. Used only
# where the input at that point is not known.
_TYPE_TAG = re.compile(r"[A-Z]|[a-z-]+\[|\[key\]$|(str|int|float|bool|none|constrained-str)$")


def validation_error(error: ValidationError, prefix: str = "", data: Any = _NO_INPUT) -> InputError:
    """The most telling pydantic error as a message that names its field. `data`, the input
    that was validated, tells the user's keys from the branch tags of a union in the error's
    location (`tool_choice.NamedToolChoice.function` is the user's `tool_choice.function`)."""
    errors = error.errors(include_url=False)
    first = _pick(errors, data)
    path = prefix
    for part in _user_path(first["loc"], data, first["type"])[0]:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            if len(part) > MAX_SHOWN_KEY:
                part = part[:MAX_SHOWN_KEY]
            path += f".{part}" if path else str(part)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return bad(f"{path}: {message}" if path else message, path or None, first["type"])


def _user_path(
    loc: tuple[int | str, ...], data: Any, kind: str
) -> tuple[list[int | str], int | None]:
    """The parts of `loc` that name the user's fields and indexes, and the position in `loc`
    of its first union branch tag (None if it has none). With the input known, a key is the
    user's when the object there has it (or it is the missing field the error is about), and
    a tag otherwise; without it, a part that reads as a type's or a class's name is a tag."""
    path: list[int | str] = []
    branch: int | None = None
    value = data
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path.append(part)
            inside = isinstance(value, list) and 0 <= part < len(value)
            value = value[part] if inside else _NO_INPUT
            continue
        if value is _NO_INPUT:
            mine = not _TYPE_TAG.match(part)
        elif isinstance(value, dict):
            mine = part in value or (i == len(loc) - 1 and kind == "missing")
        else:
            mine = False  # a string, number or list has no keys: this is a branch's tag
        if mine:
            path.append(part)
            value = value[part] if isinstance(value, dict) and part in value else _NO_INPUT
        elif branch is None:
            branch = i
    return path, branch


def _pick(errors: list[Any], data: Any) -> Any:
    """For a union (`stop: str | list[str]`, `tool_choice: "auto" | {...}`) pydantic reports
    every branch; the branch that matched the input furthest tells the user what is wrong
    (`stop[0]: must be non-empty`, not `stop: Input should be a valid string`;
    `tool_choice.function.name: Field required`, not `Input should be 'none', ...`). A branch
    whose type the input does not have (`*_type`) loses a tie."""
    first = errors[0]
    loc = tuple(first["loc"])
    branch = _user_path(loc, data, first["type"])[1]
    if branch is None:
        return first
    field = loc[:branch]
    same = [c for c in errors if tuple(c["loc"][:branch]) == field and len(c["loc"]) > branch]
    if not same:
        return first
    return max(same, key=lambda c: (len(c["loc"]), not str(c["type"]).endswith("_type")))
