"""The guard's exact reader: a body read on ijson's events (yajl), each check of
thinkbatch/guard.py's docstring made on the event that decides it, so that a refusal names the
field and nothing past a limit is ever built. thinkbatch/guard_fast.py reads the common body
faster and hands the rest of the stream to `read_events` wherever it is not certain of the
answer (`Resume`).
"""

from __future__ import annotations

import codecs
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO
from typing import Any

import ijson

from thinkbatch.errors import InputError
from thinkbatch.settings import ESCAPED_CHAR_BYTES
from thinkbatch.settings import Settings


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> InputError:
    return InputError(message, param=param, code=code)


# --- bytes ------------------------------------------------------------------------------------

# Everything that cannot start a UTF-16 surrogate escape, consumed in C: runs of other bytes,
# a backslash escape of anything but `u`, and `\u` escapes whose first hex digits are not D8-DF
# (two characters of lookahead are needed to tell, hence the `(?=..)`).
_SKIP = re.compile(rb"(?:[^\\]++|\\[^u]|\\u(?=[\s\S]{2})(?![dD][89a-fA-F]))*+")
_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_PAIR_LEN = 12
_NOT_JSON = re.compile(rb"[\x0b\x0c]")
# What the parser is handed at a time. Larger than ijson's 64 KiB: a value that spans buffers
# is read again from its start with each (Guard.run_limit), so the longest string the limits
# allow costs sixteen times less.
PARSE_CHUNK = 1 << 20
_UNBOUNDED = 1 << 40  # a limit this large is none (tests, whole files)
# What a run before a string's end holds beside its characters: the quotes, the `:` or `,`
# before it and the whitespace of any layout (json.dumps' `": "`, a pretty printer's newline
# and indentation). Without this room a string at the limit that spans the parser's pieces,
# with its layout, was refused.
_RUN_SLACK = 256


class _LongRun(Exception):
    def __init__(self, length: int):
        super().__init__(length)
        self.length = length


class Guard:
    """The request stream as the parser reads it: strict UTF-8, no lone surrogate escapes, and
    the position of every chunk so that a parse error can name its byte offset.

    An escape or a character cut by a chunk boundary is held back until the bytes that decide
    it arrive, so the parser never sees bytes that were not checked, however the body is cut.

    A read of `size` bytes ends where the body's offset is a multiple of `size` (or at its end),
    however many reads of the stream that takes: the parser is handed the same pieces of a body
    however its bytes arrive (all at once, or one at a time from a slow client), so the answer,
    the fault named first and its byte offset, never depends on that.

    ijson probes its input with read(0); werkzeug's request stream takes a zero-byte read for a
    client that went away. Answer that probe here."""

    def __init__(self, stream: IO[bytes], base: int = 0):
        self.stream = stream
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        # `base`: where the stream starts in the body (a stream handed on part-way, `Resume`).
        self.offset = base  # bytes read from the stream
        self.given = base  # bytes handed to the parser
        self.held = b""  # the start of an escape cut by a chunk boundary, not yet handed on
        self.chunk = b""  # the last chunk handed to the parser
        self.chunk_start = 0
        # yajl reads a token that spans its buffers again from its start with every buffer,
        # so one long token costs time in the square of its length (a 32 MB number, 48 s of
        # CPU). The reader notes where the parser stood at its last event (`event_at`); a
        # run of more than `run_limit` bytes since is refused before the next read.
        self.run_limit: int | None = None
        self.event_at = base
        self.eof = False

    def read(self, size: int = -1) -> bytes:
        if size == 0:
            return b""
        if self.run_limit is not None and self.given - self.event_at > self.run_limit:
            raise _LongRun(self.given - self.event_at)
        while True:
            raw = self._piece(size)
            self._check_utf8(raw)
            self._check_controls(raw)
            self.offset += len(raw)
            data, self.held = self.held + raw, b""
            safe = self._check_escapes(data, final=not raw)
            # A character cut by the chunk is checked once it is whole: held back till then.
            safe = min(safe, len(data) - len(self.decoder.getstate()[0]))
            self.held = data[safe:]
            if safe or not raw:
                break
        chunk = data[:safe]
        self.chunk, self.chunk_start = chunk, self.given
        self.given += len(chunk)
        self.eof = not chunk
        return chunk

    def _piece(self, size: int) -> bytes:
        """The stream's bytes up to the next offset that is a multiple of `size` (the rest of
        the stream for a negative size), or fewer at its end."""
        if size < 0:
            return self.stream.read()
        want = size - self.offset % size
        first = self.stream.read(want)
        if len(first) >= want or not first:
            return first  # a spooled body gives what is asked: no copy
        # A stream of short reads (a byte at a time, at worst) gathers into one buffer, not a
        # list of parts: a list of a million one-byte objects holds about 90 MB for one piece.
        piece = bytearray(first)
        while len(piece) < want:
            more = self.stream.read(want - len(piece))
            if not more:
                break
            piece += more
        return bytes(piece)

    def _check_utf8(self, raw: bytes) -> None:
        pending = len(self.decoder.getstate()[0])  # the start of a character cut by the chunk
        try:
            self.decoder.decode(raw, final=not raw)
        except UnicodeDecodeError as error:
            at = self.offset - pending + error.start + 1
            fault = bad(f"request body: invalid UTF-8 at byte {at}", code="invalid_encoding")
            fault.offset = at - 1  # type: ignore[attr-defined]  # read by read_object
            raise fault from None

    def _check_controls(self, raw: bytes) -> None:
        """A vertical tab or a form feed is never valid JSON: not whitespace between tokens
        (yajl takes them for it), and a control character inside a string must be escaped."""
        found = _NOT_JSON.search(raw)
        if found is not None:
            at = self.offset + found.start() + 1
            fault = bad(
                f"request body is not valid JSON: invalid character {found.group()!r} at byte {at}",
                code="invalid_json",
            )
            fault.offset = at - 1  # type: ignore[attr-defined]  # read by read_object
            raise fault

    def _check_escapes(self, data: bytes, *, final: bool) -> int:
        """Raise at a lone surrogate escape; return how much of data is checked."""
        base = self.given  # data starts where the parser's input stands
        pos, end = 0, len(data)
        while True:
            match = _SKIP.match(data, pos)
            assert match is not None  # the pattern matches the empty string
            pos = match.end()
            if pos >= end:
                return end
            if end - pos < _PAIR_LEN and not final:
                return pos  # decide with more bytes
            pair = _PAIR.match(data, pos)
            if pair:
                pos = pair.end()
                continue
            lone = _SURROGATE.match(data, pos)
            if lone:
                escape = lone.group().decode("ascii")
                fault = bad(
                    f"request body: {escape} at byte {base + pos + 1} is a lone UTF-16 "
                    "surrogate, not a character",
                    code="invalid_encoding",
                )
                fault.offset = base + pos  # type: ignore[attr-defined]  # read by read_object
                raise fault
            pos += 2  # `\u` and too few or malformed hex digits: the parser reports it

    def error_offset(self, message: str | bytes) -> int | None:
        """Where yajl stopped, from its error diagram: the line above the arrow shows the
        current chunk around the offset, preceded by padding that puts the offset at column
        40 (yajl_render_error_string). Returns a 1-based byte position, or None if unclear."""
        raw = message if isinstance(message, bytes) else message.encode("utf-8", "replace")
        lines = raw.split(b"\n")
        if len(lines) < 2:
            return None
        if self.eof:
            return self.given
        shown, chunk = lines[1], self.chunk.replace(b"\n", b" ").replace(b"\r", b" ")
        found = []
        for consumed in range(min(30, len(chunk) + 1)):  # near the start: 40 - n spaces
            end = min(consumed + 30, len(chunk))
            if shown == b" " * (40 - consumed) + chunk[:end]:
                found.append(consumed)
        snippet = shown[10:]
        at = chunk.find(snippet)
        while at != -1 and not found:  # further in: 10 spaces and 30 bytes either side
            consumed = at + 30
            if consumed <= len(chunk) and at + len(snippet) == min(consumed + 30, len(chunk)):
                found.append(consumed)
            at = chunk.find(snippet, at + 1)
        return self.chunk_start + found[0] if found else None


def _json_error(error: Exception, guard: Guard) -> InputError:
    message = error.args[0] if error.args else ""
    text = message.decode("utf-8", "replace") if isinstance(message, bytes) else str(message)
    reason = text.split("\n", 1)[0].strip()
    for prefix in ("parse error: ", "lexical error: "):
        reason = reason.removeprefix(prefix)
    reason = reason.rstrip(".") or "malformed"
    if guard.eof or reason == "premature EOF":
        if guard.given == 0:
            return bad("request body is empty; send a JSON object", code="invalid_json")
        return bad(
            f"request body is not valid JSON: it ends at byte {guard.given} before the JSON "
            "value is complete",
            code="invalid_json",
        )
    at = guard.error_offset(message)
    where = (
        f"at byte {at}"
        if at is not None
        else (f"between bytes {guard.chunk_start + 1} and {guard.given}")
    )
    return bad(f"request body is not valid JSON: {reason} ({where})", code="invalid_json")


# --- events ---------------------------------------------------------------------------------

_TOP, _ITEMS, _MAP, _ARRAY = range(4)
MAX_SHOWN_KEY = 64


@dataclass(frozen=True, slots=True)
class Limits:
    """What one item of a body (or one whole object, such as a batch file's line) may hold,
    checked on the parser's events before the value is built, so that no item can cost more
    memory than these allow however it is written."""

    max_depth: int
    max_messages: int = 1 << 62
    max_chars: int = 1 << 62
    max_values: int = 1 << 62
    # Where the limits' counts start again: the top-level key whose array holds the items
    # (`items` of a job body), each element counted on its own; None counts the whole object.
    items_key: str | None = "items"

    @classmethod
    def of(cls, settings: Settings, *, items_key: str | None = "items") -> Limits:
        return cls(
            max_depth=settings.max_json_depth,
            max_messages=settings.max_messages_per_item,
            max_chars=settings.max_item_chars,
            max_values=settings.max_item_values,
            items_key=items_key,
        )


# Where a stream handed on part-way (`Resume`) starts, each as the text the parser is given
# first so that what follows reads as it would have in the whole body: inside the body's
# object before its first member ("member") or after one ("after_member", a placeholder member
# `"":0`), inside the items array before its first element ("item") or after one
# ("after_item", a placeholder element `0`), or after the object ("end"). A placeholder is
# read and checked as the body's own text would be, and never yielded.
_PREFIXES = {
    "member": b"{",
    "after_member": b'{"":0',
    "item": b"[",
    "after_item": b"[0",
    "end": b"{}",
}


@dataclass(frozen=True, slots=True)
class Resume:
    """The state of a body read part-way by another reader (thinkbatch/guard_fast.py), for
    `read_events` to read the rest as if it had read all of it."""

    at: str  # a key of _PREFIXES
    start: int  # the offset in the body of the first byte handed on
    keys: frozenset[str] = frozenset()  # the body's own keys read so far
    index: int = 0  # the items yielded so far

    def prefix(self, items_key: str | None) -> bytes:
        text = _PREFIXES[self.at]
        if self.at.endswith("item"):
            assert items_key is not None  # only a body with an items array is read by items
            key = json.dumps(items_key, ensure_ascii=False).encode()
            text = b"{" + key + b":" + text
        return text


class _Frame:
    __slots__ = ("kind", "value", "key", "keys", "index")

    def __init__(self, kind: int, value: Any = None):
        self.kind = kind
        self.value = value  # the dict or list being built (None for the top level and items)
        self.key: str | None = None
        # The keys seen, where no dict being built holds them (the top level); a map's own
        # dict tells its duplicates: a key's value is in it before the next key comes.
        self.keys: set[str] | None = set() if kind == _TOP else None
        self.index = 0  # elements completed, in an array


def _path(stack: list[_Frame], child: bool = True) -> str:
    """The field at the parser's position: with child=True the element or key being read."""
    path = ""
    frames = stack if child else stack[:-1]
    for frame in frames:
        if frame.kind in (_ITEMS, _ARRAY):
            path += f"[{frame.index}]"
        elif frame.key is not None:
            key = frame.key if len(frame.key) <= MAX_SHOWN_KEY else frame.key[:MAX_SHOWN_KEY]
            path += f".{key}" if path else key
    return path


def _nul(stack: list[_Frame], what: str = "") -> InputError:
    path = _path(stack)
    return bad(f"{path or 'request body'}: {what}must not contain NUL (\\u0000)", path or None)


def _too_large(where: str, limits: Limits, values: int) -> InputError:
    shown = where or "request body"
    if values > limits.max_values:
        message = f"{shown}: holds more than {limits.max_values} JSON values (MAX_ITEM_VALUES)"
    else:
        message = f"{shown}: holds more than {limits.max_chars} characters (MAX_ITEM_CHARS)"
    return bad(message, where or None, "item_too_large")


def _too_deep(stack: list[_Frame], max_depth: int) -> InputError:
    at = _path(stack) or None
    return bad(
        f"{at or 'request body'}: nested deeper than {max_depth} levels of objects and arrays",
        at,
        "too_deep",
    )


def _run_at(stack: list[_Frame], event: str) -> str:
    """The item or top-level field a run without an event is certainly inside: the run is in
    the container on top of the stack, or after a top-level key, that key's value. Named by
    the parser's state alone, never by what the reader saw before it, so a reader resumed
    part-way (the fast reader's hand-off) names the same field as one that read it all."""
    if len(stack) >= 3 and stack[1].kind == _ITEMS:
        return _path(stack[:2])  # inside an item: items[i]
    if len(stack) >= 2 or (stack and event == "map_key"):
        return _path(stack[:1])  # inside a top-level field's value (the items array's too)
    return ""  # between the members of the body


def _in_a_request(stack: list[_Frame], items_key: str | None) -> bool:
    """Whether the map that holds the array on top of `stack` is a request, whose `messages`
    MAX_MESSAGES_PER_ITEM bounds: an element of the items array, or the `body` of a batch
    file's line (a whole object). A `messages` key elsewhere (a schema's example, metadata)
    is data of the request, bounded as all of it is."""
    if items_key is not None:
        return len(stack) == 4 and stack[1].kind == _ITEMS
    return len(stack) == 3 and stack[0].key == "body"


def _too_many_messages(stack: list[_Frame], limits: Limits) -> InputError:
    path = _path(stack, child=False)
    return bad(
        f"{path}: more than {limits.max_messages} messages (MAX_MESSAGES_PER_ITEM)",
        path,
        "too_many_messages",
    )


def read_events(
    stream: IO[bytes], limits: Limits, resume: Resume | None = None
) -> Iterator[tuple[str, Any]]:
    """Yield ("items", None) where the items array (`limits.items_key`) starts, ("item",
    value) for each of its elements and ("field", (key, value)) for every other top-level key,
    in body order.

    Objects and arrays may nest `limits.max_depth` levels (the body's own object is level 1).
    Numbers too large for the parser are refused as out of range, never a server error.

    This loop runs for every event of every item (some twenty for a plain item), so its
    checks are written out in it rather than called: the counts are locals, and a map's
    duplicate keys are found in the dict being built. It cost 7.8 us an item of a
    100,000-item job with the counts in an object and a set of keys per map."""
    guard = (
        Guard(stream)
        if resume is None
        else Guard(stream, resume.start - len(resume.prefix(limits.items_key)))
    )
    stack: list[_Frame] = []
    # A placeholder of the resumed stream's prefix is still to come: read, not yielded.
    skip = resume is not None and resume.at in ("after_member", "after_item")
    items_key = limits.items_key
    max_depth, max_values, max_chars = limits.max_depth, limits.max_values, limits.max_chars
    max_messages = limits.max_messages
    # The counts of Limits for the value being read (an item, a field, or the whole object).
    values = chars = 0
    where = ""
    done = False
    # No string the limits allow is longer than this (a character is at most an escaped
    # surrogate pair), with its quotes and the layout before it: a longer run without an event
    # is refused as it grows (Guard.run_limit).
    if max_chars < _UNBOUNDED:
        guard.run_limit = ESCAPED_CHAR_BYTES * max_chars + _RUN_SLACK
    event = ""  # the last event, as a run past the run limit is named by it (_run_at)
    try:
        for event, value in ijson.basic_parse(guard, use_float=True, buf_size=PARSE_CHUNK):
            guard.event_at = guard.given
            if event == "map_key":
                frame = stack[-1]
                frame.key = None  # the path of a bad key is its map's
                if "\x00" in value:
                    raise _nul(stack, "a key ")
                seen = frame.value if frame.keys is None else frame.keys
                if value in seen:
                    frame.key = value
                    path = _path(stack)
                    raise bad(f"{path}: duplicate key", path, "duplicate_key")
                if frame.keys is not None:
                    frame.keys.add(value)
                frame.key = value
                chars += len(value)
                continue
            if event == "string" and stack and stack[-1].kind == _MAP:
                # The most common event by far (a role, a content, an id), the checks below
                # as they apply to it: a map's member, so no new count and no array's limit.
                values += 1
                if "\x00" in value:
                    raise _nul(stack)
                chars += len(value)
                if values > max_values or chars > max_chars:
                    raise _too_large(where, limits, values)
                parent = stack[-1]
                parent.value[parent.key] = value
                continue
            opens = event == "start_map" or event == "start_array"
            closes = not opens and (event == "end_map" or event == "end_array")
            if stack and not closes:
                kind = stack[-1].kind
                if kind == _ITEMS:
                    values = chars = 0  # a new item: its own counts
                    where = _path(stack)
                elif kind == _TOP and items_key is not None:
                    values = chars = 0  # a field of the job: its own too
                    where = stack[-1].key or ""
            if opens:
                if len(stack) >= max_depth:
                    raise _too_deep(stack, max_depth)
                if not stack:
                    if event != "start_map":
                        raise bad("request body: Input should be an object", code="invalid_type")
                    stack.append(_Frame(_TOP))
                    if resume is not None and resume.at == "member":
                        stack[0].keys = set(resume.keys)
                    continue
                parent = stack[-1]
                if parent.kind == _TOP and items_key is not None and parent.key == items_key:
                    if event != "start_array":
                        raise bad(
                            f"{items_key}: Input should be a valid array",
                            items_key,
                            "list_type",
                        )
                    stack.append(_Frame(_ITEMS))
                    if resume is not None and resume.at in ("item", "after_item"):
                        stack[0].keys = set(resume.keys)
                        stack[-1].index = resume.index - skip  # the placeholder's place
                        continue  # its start was yielded by the reader before
                    yield "items", None
                    continue
            elif closes:
                value = stack.pop().value
                if not stack:
                    done = True  # read on: anything after the object is an error of yajl's
                    continue
                if stack[-1].kind == _TOP and items_key is not None and stack[-1].key == items_key:
                    continue  # the items frame yielded its elements one by one
            elif not stack:
                raise bad("request body: Input should be an object", code="invalid_type")
            if not closes:  # a value: an object or an array it opens, or a scalar
                values += 1
                if value.__class__ is str:
                    if "\x00" in value:
                        raise _nul(stack)
                    chars += len(value)
                if values > max_values or chars > max_chars:
                    raise _too_large(where, limits, values)
                parent = stack[-1]
                if (
                    parent.kind == _ARRAY
                    and parent.index >= max_messages
                    and len(stack) >= 2
                    and stack[-2].key == "messages"
                    and _in_a_request(stack, items_key)
                ):
                    raise _too_many_messages(stack, limits)
                if opens:
                    stack.append(_Frame(_MAP, {}) if event == "start_map" else _Frame(_ARRAY, []))
                    continue
            parent = stack[-1]
            kind = parent.kind
            if kind == _MAP:
                parent.value[parent.key] = value
            elif kind == _ARRAY:
                parent.value.append(value)
                parent.index += 1
            elif kind == _ITEMS:
                if skip:
                    skip = False
                else:
                    yield "item", value
                parent.index += 1
            else:
                if items_key is not None and parent.key == items_key:
                    raise bad(f"{items_key}: Input should be a valid array", items_key, "list_type")
                if skip and resume is not None:
                    skip = False
                    parent.keys = set(resume.keys)  # the placeholder's key was not the body's
                    values = chars = 0
                else:
                    yield "field", (parent.key, value)
    except _LongRun as error:
        at = _run_at(stack, event)
        raise bad(
            f"{at or 'request body'}: {error.length} bytes without the end of a value, longer"
            f" than any string of {max_chars} characters (MAX_ITEM_CHARS) can be",
            at or None,
            "item_too_large",
        ) from None
    except ijson.JSONError as error:
        reason = str(error.args[0] if error.args else "")
        if "overflow" in reason and stack:  # a number yajl cannot hold, at the current field
            path = _path(stack)
            kind_name = "integer" if "integer" in reason else "number"
            raise bad(
                f"{path}: {kind_name} out of range", path, f"{kind_name}_out_of_range"
            ) from None
        raise _json_error(error, guard) from None
    if not done:
        raise _json_error(ijson.IncompleteJSONError("premature EOF"), guard)


def path_at(prefix: bytes, max_depth: int) -> str:
    """The field a JSON text is inside where `prefix` ends (the text before a fault, which is
    well-formed so far): its events are followed as read_body follows them. A prefix nested
    deeper than `max_depth` holds the first fault itself, and it is raised: the path to the
    later one would be as long as the nesting (a line of a million `[`, 3 MB)."""
    stack: list[_Frame] = []
    try:
        for event, value in ijson.basic_parse(io.BytesIO(prefix), use_float=True):
            if event == "map_key":
                stack[-1].key = value
            elif event in ("start_map", "start_array"):
                if len(stack) >= max_depth:
                    raise _too_deep(stack, max_depth)
                stack.append(_Frame(_MAP if event == "start_map" else _ARRAY))
            elif event in ("end_map", "end_array"):
                stack.pop()
                if stack and stack[-1].kind == _ARRAY:
                    stack[-1].index += 1
            elif stack and stack[-1].kind == _ARRAY:
                stack[-1].index += 1
    except ijson.JSONError:
        pass  # the prefix ends in the middle of a value: that is the point
    return _path(stack) if stack else ""
