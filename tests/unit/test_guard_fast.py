"""The guard's fast reader (thinkbatch/guard_fast.py) against its exact reader
(thinkbatch/guard_events.py `read_events`): for any body, valid or hostile, cut into chunks of any
size, both give the same answer, the same values or the same refusal naming the same field, and
the fast reader reads a plain body without the exact reader."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st

from thinkbatch import guard_fast
from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import read_body
from thinkbatch.guard import read_object
from thinkbatch.guard_events import read_events

TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
NUMBERS = st.integers(-(2**64), 2**64) | st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.none() | st.booleans() | NUMBERS | TEXT
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["messages", "role", "a", "é"]) | TEXT, inner, max_size=3)
    ),
    max_leaves=16,
)
# Text that can turn a body hostile wherever it lands.
HOSTILE = st.sampled_from(
    [
        b'"\\u0000"', b"\\u0000", b"NaN", b"-Infinity", b"9223372036854775808", b"1e999",
        b"01", b"1.", b",", b"]", b"}", b"[", b"{", b'"', b":", b'{"a":1,"a":2}', b"\xff",
        b"\xed\xa0\x80", b"\xe2\x82", b'"\\ud800"', b"\\udc00", b"[" * 40 + b"]" * 40,
        b'{"messages":[1,2,3,4,5,6,7]}', b"\t", b"\x01", b"\xef\xbb\xbf", b" x",
        b"-9223372036854775808", b"\x0b", b"\x0c",
    ]
)  # fmt: skip


class Trickle:
    """A request stream that hands out at most `step` bytes a read."""

    def __init__(self, data: bytes, step: int):
        self.data, self.step, self.pos = data, step, 0

    def read(self, size: int = -1) -> bytes:
        n = self.step if size < 0 else min(size, self.step)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += len(chunk)
        return chunk


def outcome(reader: Any, data: bytes, step: int, limits: Limits) -> tuple[Any, ...]:
    try:
        return ("ok", list(reader(Trickle(data, step), limits)))
    except InputError as error:
        return ("refused", error.message, error.param, error.code)


def _mutated(draw: st.DrawFn, data: bytes) -> bytes:
    change = draw(st.sampled_from(["none", "insert", "replace", "cut"]))
    at = draw(st.integers(0, len(data)))
    if change == "insert":
        return data[:at] + draw(HOSTILE) + data[at:]
    if change == "replace":
        return data[:at] + draw(HOSTILE) + data[at + draw(st.integers(1, 4)) :]
    return data[:at] if change == "cut" else data


def _dumped(draw: st.DrawFn, value: Any) -> bytes:
    separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]))
    return json.dumps(value, separators=separators, ensure_ascii=draw(st.booleans())).encode()


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    fields = draw(st.dictionaries(st.sampled_from(["params", "model", "messages", "x"]), VALUES))
    items = draw(st.lists(VALUES, max_size=5))
    after = draw(st.booleans())
    body = {**({} if after else fields), "items": items, **(fields if after else {})}
    return _mutated(draw, _dumped(draw, body))


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    line = draw(st.dictionaries(st.sampled_from(["custom_id", "body", "messages"]) | TEXT, VALUES))
    return _mutated(draw, _dumped(draw, line))


LIMITS = st.builds(
    Limits,
    max_depth=st.integers(5, 8),
    max_messages=st.integers(1, 6),
    max_chars=st.integers(4, 400) | st.just(1 << 62),
    max_values=st.integers(3, 60) | st.just(1 << 62),
)


STEPS = (65536, 7, 1)


@settings(max_examples=500, deadline=None)
@given(bodies(), LIMITS)
def test_both_readers_give_the_same_answer(data: bytes, limits: Limits) -> None:
    # However the body arrives: the same answer, the same fault named first, the same offset.
    exact = {step: outcome(read_events, data, step, limits) for step in STEPS}
    fast = {step: outcome(read_body, data, step, limits) for step in STEPS}
    assert fast == exact
    assert all(answer == exact[STEPS[0]] for answer in exact.values()), exact


@pytest.mark.parametrize(
    "data",
    [
        b'{"items":[{"a":00}]}',
        b'{"x":1 "items":[]}',
        b'{"a":00,"items":[]}',
        b'{"items":[{"p":' + b" " * 400 + b'"a"}]}',  # a run past the limit's in one read
        b'{"items":[{"p":0.' + b"0" * 400 + b"1}]}",
        b'{"items":[{"a":"\xff"}, x]}',  # two faults: the bytes' and the parser's
    ],
)
def test_a_body_is_answered_alike_however_its_bytes_arrive(data: bytes) -> None:
    limits = Limits(max_depth=5, max_chars=4)
    answers = {repr(outcome(reader, data, step, limits)) for reader in (read_events, read_body)
               for step in (*STEPS, 2, 3, 1000)}  # fmt: skip
    assert len(answers) == 1, answers


@settings(max_examples=200, deadline=None)
@given(bodies(), LIMITS)
def test_values_past_the_read_ahead_go_to_the_exact_reader(data: bytes, limits: Limits) -> None:
    # A value longer than READ_AHEAD is the exact reader's, whatever it holds.
    exact = outcome(read_events, data, 5, limits)
    with mock.patch.object(guard_fast, "READ_AHEAD", 16):
        fast = outcome(read_body, data, 5, limits)
    assert fast == exact


@settings(max_examples=500, deadline=None)
@given(lines(), LIMITS)
def test_a_whole_object_reads_the_same(data: bytes, limits: Limits) -> None:
    whole = Limits(limits.max_depth, limits.max_messages, limits.max_chars, limits.max_values, None)

    def read(reader: Any) -> tuple[Any, ...]:
        try:
            return ("ok", reader())
        except InputError as error:
            return ("refused", error.message, error.param, error.code)

    # read_object names the field a fault of the bytes is in; the exact reader alone, under it.
    with mock.patch.object(guard_fast, "read_whole", lambda data, limits: None):
        exact = read(lambda: read_object(data, limits))
    assert read(lambda: read_object(data, limits)) == exact
    if exact[0] == "ok":
        assert exact[1] == dict(v for _, v in read_events(Trickle(data, 65536), whole))  # type: ignore[arg-type]


def _handed_on(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The resumes of the exact reader, recorded while the fast reader reads."""
    resumes: list[Any] = []

    def spy(stream: Any, limits: Limits, resume: Any = None) -> Any:
        resumes.append(resume)
        return read_events(stream, limits, resume)

    monkeypatch.setattr(guard_fast, "read_events", spy)
    return resumes


def test_a_plain_body_is_read_without_the_exact_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    resumes = _handed_on(monkeypatch)
    body = {
        "params": {"max_tokens": 64, "temperature": 0.5},
        "items": [
            {"custom_id": f"r{k}", "messages": [{"role": "user", "content": f"é {k} 😀"}]}
            for k in range(2000)
        ],
        "metadata": {"team": "eval"},
    }
    data = json.dumps(body).encode()  # \u escapes, surrogate pairs among them
    read = list(read_body(Trickle(data, 4096), Limits(max_depth=32)))  # type: ignore[arg-type]
    assert read[0] == ("field", ("params", body["params"]))
    assert [v for kind, v in read if kind == "item"] == body["items"]
    assert read[-1] == ("field", ("metadata", body["metadata"]))
    assert resumes == []


def test_a_doubt_hands_on_the_rest_from_the_item_it_is_in(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    resumes = _handed_on(monkeypatch)
    items = [{"prompt": f"q{k}"} for k in range(5)]
    data = json.dumps({"items": items}).encode().replace(b'"q3"', b'"q\\u00003"')
    with pytest.raises(InputError) as refused:
        list(read_body(Trickle(data, 65536), Limits(max_depth=32)))  # type: ignore[arg-type]
    assert refused.value.param == "items[3].prompt"
    assert [(r.at, r.index) for r in resumes] == [("after_item", 3)]
    # A doubt the exact reader clears: the items come out once each, in order.
    data = json.dumps({"items": items}).encode().replace(b'"q3"', b'"q\\\\u00003"')
    read = [
        v for kind, v in read_body(Trickle(data, 65536), Limits(max_depth=32)) if kind == "item"
    ]  # type: ignore[arg-type]
    assert read == [*items[:3], {"prompt": "q\\u00003"}, *items[4:]]


EDGES = [
    # yajl refuses -2**63 (it builds the magnitude first), so the fast reader does too.
    (b'{"items":[{"n":-9223372036854775808}]}', "integer_out_of_range"),
    (b'{"items":[{"n":-9223372036854775807}]}', None),
    # A vertical tab or a form feed is not JSON whitespace, nor allowed raw in a string.
    (b'{"items":[]}\x0b', "invalid_json"),
    (b'\x0c{"items":[]}', "invalid_json"),
    (b'{"items":[1,\x0b2]}', "invalid_json"),
    (b'{"items":[{"prompt":"a\x0cb"}]}', "invalid_json"),
]


@pytest.mark.parametrize(("data", "code"), EDGES)
@pytest.mark.parametrize("step", STEPS)
def test_both_readers_draw_the_same_line_at_the_edges(
    data: bytes, code: str | None, step: int
) -> None:
    limits = Limits(max_depth=32)
    for reader in (read_events, read_body):
        answer = outcome(reader, data, step, limits)
        assert answer[0] == ("ok" if code is None else "refused"), (reader, answer)
        if code is not None:
            assert answer[3] == code, answer
    line = data.replace(b'{"items":[', b'{"custom_id":"x","v":[', 1)
    whole = Limits(32, 1024, 1 << 62, 1 << 62, None)
    try:
        read_object(line, whole)
        got = None
    except InputError as error:
        got = error.code
    assert got == code


def test_a_fault_of_the_bytes_is_named_by_a_path_no_deeper_than_the_limit() -> None:
    whole = Limits(32, 1024, 1 << 62, 1 << 62, None)
    with pytest.raises(InputError) as shallow:
        read_object(b'{"custom_id":"a","body":{"x":[1,"\xff"]}}', whole)
    assert (shallow.value.code, shallow.value.param) == ("invalid_encoding", "body.x[1]")
    # Past the depth limit the nesting is the first fault: its path is 32 levels, not the
    # 100,000 of the bytes' fault after it.
    nested = b'{"custom_id":"a","body":' + b"[" * 100_000
    with pytest.raises(InputError) as deep:
        read_object(nested + b"\xff", whole)
    with pytest.raises(InputError) as well_formed:
        read_object(nested + b"1" + b"]" * 100_000 + b"}", whole)
    assert (deep.value.code, deep.value.param) == ("too_deep", "body" + "[0]" * 31)
    assert deep.value.message == well_formed.value.message


def test_only_a_requests_messages_are_bounded_by_the_messages_limit() -> None:
    # A `messages` key inside a request (a schema's example, metadata) is its data: bounded by
    # the item limits as all of it is, not by MAX_MESSAGES_PER_ITEM.
    many = [{"role": "user", "content": "x"}] * 3
    schema = {"type": "object", "examples": [{"messages": many}]}
    params = {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
    item = {"messages": many[:2], "params": params, "metadata": {"messages": many}}
    limits = Limits(max_depth=12, max_messages=2)
    data = json.dumps({"items": [item]}).encode()
    for step in STEPS:
        for reader in (read_events, read_body):
            assert outcome(reader, data, step, limits) == ("ok", [("items", None), ("item", item)])
    line = {"custom_id": "a", "body": item}
    whole = Limits(12, 2, 1 << 62, 1 << 62, None)
    assert read_object(json.dumps(line).encode(), whole) == line
    # The request's own are.
    body = json.dumps({"items": [{**item, "messages": many}]}).encode()
    for step in STEPS:
        for reader in (read_events, read_body):
            refused = outcome(reader, body, step, limits)
            assert refused[2:] == ("items[0].messages", "too_many_messages"), refused
    with pytest.raises(InputError) as in_a_line:
        read_object(json.dumps({**line, "body": {**item, "messages": many}}).encode(), whole)
    assert (in_a_line.value.param, in_a_line.value.code) == ("body.messages", "too_many_messages")


def test_a_long_run_of_whitespace_is_not_held_by_the_fast_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fast reader keeps its text from the last point the exact reader could start from,
    copied on every chunk: whitespace past READ_AHEAD goes to the exact reader, so what it
    holds stays bounded (and its work linear) however long the run."""
    resumes = _handed_on(monkeypatch)
    held: list[int] = []
    more = guard_fast._Reader.more

    def recording(self: Any) -> bool:
        held.append(len(self.text))
        return more(self)

    monkeypatch.setattr(guard_fast._Reader, "more", recording)
    space = b" \n\t" * (1 << 20)  # 3 MiB
    items = b'{"prompt":"a"}'
    for data in (space + b'{"items":[' + items + b"]}", b'{"items":[' + items + b"," + space
                 + items + b"]}" + space):  # fmt: skip
        resumes.clear()
        held.clear()
        read = [
            v for kind, v in read_body(Trickle(data, 65536), Limits(max_depth=32)) if kind == "item"
        ]  # type: ignore[arg-type]
        assert read == [{"prompt": "a"}] * data.count(items)
        assert resumes  # handed on
        assert max(held) <= guard_fast.READ_AHEAD + 2 * guard_fast.CHUNK


LONG_RUNS = [
    b'"' + b"x" * (4 << 20) + b'"',  # a string
    b"1" * (4 << 20),  # a number
    b'"' + b"\\n" * (2 << 20) + b'"',  # a string of escapes
    b" " * (4 << 20) + b"1",  # whitespace
]


@pytest.mark.parametrize("token", LONG_RUNS, ids=["string", "number", "escapes", "whitespace"])
@pytest.mark.parametrize("reader", [read_events, read_body])
def test_a_run_longer_than_any_allowed_string_is_refused_as_it_grows(
    token: bytes, reader: Any
) -> None:
    """yajl reads a token that spans its buffers again from its start with each one: a run of
    bytes without a value's end, past what the longest allowed string can take, is refused
    before the rest of it is read (and read again)."""
    limits = Limits(max_depth=32, max_chars=100_000)
    data = b'{"items":[{"prompt":"a"},{"prompt":' + token + b"}]}"
    stream = Trickle(data, 1 << 20)
    with pytest.raises(InputError) as refused:
        list(reader(stream, limits))
    assert (refused.value.code, refused.value.param) == ("item_too_large", "items[1]")
    assert "MAX_ITEM_CHARS" in refused.value.message
    # Refused within a buffer or two of the limit: most of the run was never read.
    assert stream.pos <= 6 * 100_000 + 3 * (1 << 20) < len(data)


RUN_PLACES = [
    # (the body around the run, the field named)
    (b'{"items":[{"prompt":"a"}],"x":%s}', "x"),  # a field after the items
    (b'{"x":1,"items":[{"prompt":"a"}],"y":[1,%s]}', "y"),
    (b'{"x":{"k":1},"y":%s}', "y"),  # a field after another (no items yet)
    (b'{"items":[{"prompt":"a"},%s]}', "items"),  # an item that is the run itself
    (b'{"items":[{"prompt":"a"}],"z":1,%s:1}', None),  # a key: between the members
    (b'{"x":[1],"items":[{"prompt":"a"},{"m":{"k":[%s]}}]}', "items[1]"),
]


@pytest.mark.parametrize(("body", "field"), RUN_PLACES)
@pytest.mark.parametrize("token", LONG_RUNS[:1] + LONG_RUNS[3:], ids=["string", "whitespace"])
def test_a_long_run_is_named_by_the_field_it_is_inside(
    body: bytes, field: str | None, token: bytes
) -> None:
    """A run past the run limit names the item or top-level field it is certainly inside, never
    a field read before it: the same for both readers, however the body arrives."""
    limits = Limits(max_depth=32, max_chars=100_000)
    data = body % token
    for reader in (read_events, read_body):
        for step in (1 << 20, 65536, 7919):
            with pytest.raises(InputError) as refused:
                list(reader(Trickle(data, step), limits))
            assert (refused.value.code, refused.value.param) == ("item_too_large", field)


@pytest.mark.parametrize("layout", [{"separators": (",", ":")}, {}, {"indent": 8}])
@pytest.mark.parametrize("where", ["key", "value"])
def test_a_string_of_escaped_pairs_at_the_limit_is_read(where: str, layout: Any) -> None:
    # One character outside the BMP, twelve bytes as an escaped surrogate pair: the longest run
    # the limits allow, read whole however the body is cut and whatever its layout.
    text = "\U0001f600" * 6
    item = {text: None} if where == "key" else {"": text}
    data = json.dumps({"items": [item]}, **layout).encode()
    assert data.count(b"\\ud83d\\ude00") == len(text)
    limits = Limits(max_depth=5, max_chars=len(text))
    for step in STEPS:
        for reader in (read_events, read_body):
            assert outcome(reader, data, step, limits) == ("ok", [("items", None), ("item", item)])


def test_a_number_is_read_as_the_nearest_double() -> None:
    # As any JSON parser reads it: below the smallest double is 0 (its sign kept), the
    # smallest subnormal is itself, and above the largest is refused as out of range.
    data = b'{"items":[{"a":[1e-400,-1e-400,5e-324,0.1]}]}'
    for step in STEPS:
        for reader in (read_events, read_body):
            answer, [_, (_, item)] = outcome(reader, data, step, Limits(max_depth=5))
            assert (answer, item["a"]) == ("ok", [0.0, -0.0, 5e-324, 0.1])
            assert str(item["a"][1]) == "-0.0"
    huge = b'{"items":[{"a":1e309}]}'
    for reader in (read_events, read_body):
        assert outcome(reader, huge, 7, Limits(max_depth=5))[3] == "number_out_of_range"


def test_the_longest_allowed_string_is_read() -> None:
    limits = Limits(max_depth=32, max_chars=100_000)
    text = "é" * (100_000 - len("prompt"))  # a key's characters count too
    data = json.dumps({"items": [{"prompt": text}]}).encode()  # \u00e9: 6 bytes a character
    assert len(data) > 6 * 99_000
    for reader in (read_events, read_body):
        assert list(reader(Trickle(data, 65536), limits)) == [  # type: ignore[arg-type]
            ("items", None),
            ("item", {"prompt": text}),
        ]


def test_a_body_read_a_byte_at_a_time_is_held_in_one_buffer() -> None:
    """A stream that hands out one byte a read (a body not spooled, from a trickling client)
    costs the guard about the piece it gathers, not an object per byte (a list of a million
    one-byte parts held some 90 MB)."""
    import tracemalloc

    from thinkbatch.guard_events import PARSE_CHUNK
    from thinkbatch.guard_events import Guard

    data = b'{"items":[{"prompt":"' + b"a" * PARSE_CHUNK + b'"}]}'
    guard = Guard(Trickle(data, 1))
    tracemalloc.start()
    try:
        piece = guard.read(PARSE_CHUNK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert piece == data[:PARSE_CHUNK]
    assert peak < 4 * PARSE_CHUNK
