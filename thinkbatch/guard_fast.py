"""The guard's fast reader: a job body's items (and a whole batch-file line) decoded one value
at a time by Python's JSON decoder, in C, where the exact reader (thinkbatch/guard_events.py)
runs a Python loop over some twenty parser events an item.

It accepts a value only where it is certain the exact reader would accept it and build the same
value; anywhere else it hands the rest of the stream to the exact reader, which reads on from
that point as if it had read the whole body (`Resume`), and whose answer, the values or the
refusal naming the field, is then the answer. So every refusal, and its message, is the exact
reader's; this reader only answers sooner for a body with nothing to refuse. Certain means:

- the value decodes in full, with no duplicate key in any object, no `NaN` or `Infinity`, no
  integer outside 64 bits and no float that overflows (yajl refuses all of these; Python's
  decoder accepts them unless told not to), and no request's `messages` array (an item's, a
  batch line's body's) longer than the limit;
- its text holds no `\\u0000` escape (NUL; a raw control character is refused by both);
- its text is no longer than the item's limits on JSON values and characters (each value and
  each character takes at least one character of text), and its objects and arrays, counted in
  its text or, past that, in the value, nest no deeper than the depth allowed where it stands.

Bytes are checked before either decoder sees them (guard_events.Guard: strict UTF-8, no lone
surrogate escape). A value of more than READ_AHEAD characters is left to the exact reader,
which reads it in bounded memory, so this reader holds at most that much text and a chunk.
"""

from __future__ import annotations

import codecs
import functools
import io
import json
import re
from collections.abc import Iterator
from json.decoder import scanstring  # type: ignore[attr-defined]  # C, where available
from typing import IO
from typing import Any
from typing import cast

from thinkbatch.errors import InputError
from thinkbatch.guard_events import Guard
from thinkbatch.guard_events import Limits
from thinkbatch.guard_events import Resume
from thinkbatch.guard_events import read_events

CHUNK = 64 * 1024  # as ijson reads
READ_AHEAD = 256 * 1024
_WS = re.compile(r"[ \t\n\r]*")
_SPACE = " \t\n\r"
_AFTER = frozenset(",]}" + _SPACE)  # what may follow a value
_INT64 = 1 << 63
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class _Doubt(ValueError):
    """This reader is not certain: the exact reader decides."""


def _holds_too_many_messages(request: Any, max_messages: int) -> bool:
    """Whether `request` (an item, a batch line's body) has more messages than the limit."""
    if request.__class__ is not dict:
        return False
    messages = request.get("messages")
    return messages.__class__ is list and len(messages) > max_messages


@functools.cache
def _decoder() -> json.JSONDecoder:
    """One decoder: a batch file's lines are read one reader each, and making the decoder and
    its scanner cost more than reading a line."""

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        value = dict(items)
        if len(value) != len(items):
            raise _Doubt("duplicate key")
        return value

    def integer(text: str) -> int:
        value = int(text)
        # yajl builds the magnitude before its sign: it refuses -2**63 too, and so do we.
        if len(text) > 18 and not -_INT64 < value < _INT64:
            raise _Doubt("integer overflow")
        return value

    def number(text: str) -> float:
        value = float(text)
        if value in (float("inf"), float("-inf")):
            raise _Doubt("float overflow")
        return value

    def constant(text: str) -> Any:
        raise _Doubt(text)

    return json.JSONDecoder(
        object_pairs_hook=pairs, parse_int=integer, parse_float=number, parse_constant=constant
    )


def _depth(value: Any) -> int:
    """How deep `value`'s objects and arrays nest (a scalar 0, `[]` 1)."""
    if value.__class__ is dict:
        return 1 + max(map(_depth, value.values()), default=0)
    if value.__class__ is list:
        return 1 + max(map(_depth, value), default=0)
    return 0


class _Handed(Exception):
    """Raised inside the reader to hand the rest of the stream on."""


class _Reader:
    def __init__(self, stream: IO[bytes], limits: Limits):
        self.raw = _Recorder(stream)
        self.guard = Guard(self.raw)  # type: ignore[arg-type]
        self.unread = b""  # what the guard took from the stream and refused to hand on
        self.limits = limits
        # The decoder's scanner itself: raw_decode is a Python frame around it.
        self.scan = _decoder().scan_once  # type: ignore[attr-defined]
        self.utf8 = codecs.getincrementaldecoder("utf-8")("strict")
        self.text = ""
        self.pos = 0
        self.base = 0  # the body's bytes before text[0]
        self.eof = False
        # The last point the exact reader can start from (Resume.at) and its place in text.
        self.mark = ("start", 0)
        self.keys: set[str] = set()
        self.index = 0
        # Each value's text is at most this long for its counts to be certain.
        self.bound = min(limits.max_values, limits.max_chars)

    # --- text ---

    def more(self) -> bool:
        """Read a chunk into the text, dropping what lies before the mark; False at the end."""
        if self.eof:
            return False
        held, self.raw.taken = self.guard.held, b""
        try:
            chunk = self.guard.read(CHUNK)
        except InputError:
            # A fault of the bytes: the exact reader reads them again, and tells it where it
            # would have (after an object, say, yajl reports the bytes before the fault).
            self.unread = held + self.raw.taken
            raise _Handed from None
        self.eof = not chunk
        at = self.mark[1]
        gone = self.text[:at]
        self.base += len(gone) if gone.isascii() else len(gone.encode())
        self.text = self.text[at:] + self.utf8.decode(chunk, final=self.eof)
        self.pos -= at
        self.mark = (self.mark[0], 0)
        return True

    def peek(self) -> str:
        """The next character that is not whitespace, at self.pos ('' at the end)."""
        pos, text = self.pos, self.text
        if pos < len(text) and text[pos] not in _SPACE:  # most often: no whitespace to skip
            return text[pos]
        while True:
            self.pos = _WS.match(self.text, self.pos).end()  # type: ignore[union-attr]
            if self.pos < len(self.text):
                return self.text[self.pos]
            # The text since the mark is kept, and copied on each chunk: a long run of
            # whitespace goes to the exact reader, which reads it in constant memory.
            if len(self.text) - self.mark[1] > READ_AHEAD or not self.more():
                if not self.eof:
                    raise _Handed
                return ""

    def handed(self) -> Iterator[tuple[str, Any]]:
        """The rest of the body, read by the exact reader from the mark."""
        at, where = self.mark
        # The bytes read and not yet parsed: the text's, a character cut at the end of the last
        # chunk, and what the guard held back or refused. The exact reader's own guard checks
        # them again, and reads the rest of the stream itself.
        tail = self.unread or self.guard.held
        rest = self.text[where:].encode() + self.utf8.getstate()[0] + tail
        consumed = self.text[:where]
        start = self.base + (len(consumed) if consumed.isascii() else len(consumed.encode()))
        if at == "start":
            return read_events(_Chain.of(rest, self.raw.stream), self.limits)
        resume = Resume(at, start, frozenset(self.keys), self.index)
        stream = _Chain.of(resume.prefix(self.limits.items_key) + rest, self.raw.stream)
        return read_events(stream, self.limits, resume)

    # --- values ---

    def value(self, level: int) -> Any:
        """The value at self.pos, `level` frames deep in the exact reader's stack, if certain."""
        start = self.pos
        while True:
            try:
                value, end = self.scan(self.text, start)
            except _Doubt:
                raise _Handed from None
            except (StopIteration, ValueError, RecursionError):
                end = -1  # not a value yet, or not one at all
            # A value ends where a delimiter follows it: a number at the end of the text, or
            # followed by what no number ends with (`1e` of `1e+16`), may go on in the next chunk.
            if end >= 0 and (
                self.text[end : end + 1] in _AFTER or (self.eof and end == len(self.text))
            ):
                break
            if len(self.text) - start > READ_AHEAD or not self.more():
                raise _Handed
            start = self.pos
        text = self.text
        if end - start > self.bound or text.find("\\u0000", start, end) >= 0:
            raise _Handed
        room = self.limits.max_depth - level
        if text.count("{", start, end) + text.count("[", start, end) > room:
            try:
                if _depth(value) > room:
                    raise _Handed
            except RecursionError:
                raise _Handed from None
        self.pos = end
        return value

    def key(self) -> str:
        while True:
            try:
                key: str
                key, end = scanstring(self.text, self.pos + 1, True)
            except ValueError:
                if len(self.text) - self.pos > READ_AHEAD or not self.more():
                    raise _Handed from None
                continue
            if self.text.find("\\u0000", self.pos, end) >= 0 or key in self.keys:
                raise _Handed
            self.pos = end
            return key

    # --- the body ---

    def read(self) -> Iterator[tuple[str, Any]]:
        items_key = self.limits.items_key
        if self.peek() != "{":
            raise _Handed
        self.pos += 1
        self.mark = ("member", self.pos)
        if self.peek() == "}":
            self.pos += 1
        else:
            while True:
                if self.peek() != '"':
                    raise _Handed
                key = self.key()
                if self.peek() != ":":
                    raise _Handed
                self.pos += 1
                if key == items_key and items_key is not None:
                    if self.peek() != "[":
                        raise _Handed
                    self.pos += 1
                    self.keys.add(key)
                    yield "items", None
                    yield from self.items()
                else:
                    self.peek()
                    value = self.value(1)
                    self.keys.add(key)
                    yield "field", (key, value)
                self.mark = ("after_member", self.pos)
                sep = self.peek()
                if sep == "}":
                    self.pos += 1
                    break
                if sep != ",":
                    raise _Handed
                self.pos += 1
        self.mark = ("end", self.pos)
        if self.peek() != "":
            raise _Handed

    def items(self) -> Iterator[tuple[str, Any]]:
        self.mark = ("item", self.pos)
        if self.peek() == "]":
            self.pos += 1
            return
        while True:
            self.peek()
            value = self.value(2)
            if _holds_too_many_messages(value, self.limits.max_messages):
                raise _Handed
            yield "item", value
            self.index += 1
            self.mark = ("after_item", self.pos)
            sep = self.peek()
            if sep == "]":
                self.pos += 1
                return
            if sep != ",":
                raise _Handed
            self.pos += 1


class _Recorder:
    """The request stream, keeping what one read of the guard took from it."""

    def __init__(self, stream: IO[bytes]):
        self.stream = stream
        self.taken = b""

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.taken += data
        return data


class _Chain(io.RawIOBase):
    """Bytes already read, then the rest of a stream."""

    def __init__(self, head: bytes, rest: IO[bytes]):
        self.head, self.rest = head, rest

    @classmethod
    def of(cls, head: bytes, rest: IO[bytes]) -> IO[bytes]:
        return cast(IO[bytes], cls(head, rest))

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if self.head:
            n = len(self.head) if size < 0 else max(size, 1)
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.rest.read(size) if size != 0 else b""


def read_body(stream: IO[bytes], limits: Limits) -> Iterator[tuple[str, Any]]:
    """guard.read_body: the fast reader, and the exact one from wherever it is not certain.
    A whole object (`items_key` None) is counted as one: see `read_whole`."""
    if limits.items_key is None:
        yield from read_events(stream, limits)
        return
    reader = _Reader(stream, limits)
    try:
        yield from reader.read()
    except _Handed:
        yield from reader.handed()


def read_whole(data: bytes, limits: Limits) -> dict[str, Any] | None:
    """A whole object (a batch file's line) decoded in one call, where certain; None for the
    exact reader to read it. Its counts are over the whole object, so only a text within
    them is certain; its bytes are checked here as the guard checks them (strict UTF-8, and
    any surrogate escape, a pair too, left to the exact reader)."""
    if len(data) > min(limits.max_values, limits.max_chars):
        return None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return None
    if _SURROGATE_ESCAPE.search(text) or text.find("\\u0000") >= 0:
        return None
    start = _WS.match(text).end()  # type: ignore[union-attr]
    try:
        value, end = _decoder().scan_once(text, start)  # type: ignore[attr-defined]
    except (StopIteration, ValueError, RecursionError):
        return None
    if value.__class__ is not dict or _WS.match(text, end).end() != len(text):  # type: ignore[union-attr]
        return None
    if _holds_too_many_messages(value.get("body"), limits.max_messages):
        return None
    # The object is level 1, as in the exact reader's stack.
    if text.count("{") + text.count("[") > limits.max_depth:
        try:
            if _depth(value) > limits.max_depth:
                return None
        except RecursionError:
            return None
    return cast(dict[str, Any], value)
