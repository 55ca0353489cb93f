"""The guard's event loop (thinkbatch/guard.py `read_body`) against a model of it written
plainly: for any JSON body it yields what `json.loads` reads, item by item and field by
field; it refuses a duplicate key at any level (the body's own keys included) and NUL in any
string or key, naming where; and it refuses an item exactly when its JSON values, its
characters, its nesting or its messages pass the limits, counted as the model counts them."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import read_body

# Characters PostgreSQL can store: no NUL, no lone surrogate (the guard refuses both).
TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=12,
)
SCALARS = st.none() | st.booleans() | st.integers(-(2**62), 2**62) | TEXT
SCALARS |= st.floats(allow_nan=False, allow_infinity=False)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=24,
)


def _read(body: dict[str, Any], limits: Limits) -> tuple[list[Any], dict[str, Any]]:
    items: list[Any] = []
    fields: dict[str, Any] = {}
    for kind, value in read_body(io.BytesIO(json.dumps(body).encode()), limits):
        if kind == "item":
            items.append(value)
        elif kind == "field":
            fields[value[0]] = value[1]
    return items, fields


def _counts(value: Any) -> tuple[int, int]:
    """JSON values (each object, array and scalar is one) and characters (of strings and
    keys) in `value`: what MAX_ITEM_VALUES and MAX_ITEM_CHARS bound."""
    if isinstance(value, dict):
        inner = [_counts(v) for v in value.values()]
        keys = sum(len(k) for k in value)
        return 1 + sum(v for v, _ in inner), keys + sum(c for _, c in inner)
    if isinstance(value, list):
        inner = [_counts(v) for v in value]
        return 1 + sum(v for v, _ in inner), sum(c for _, c in inner)
    return 1, len(value) if isinstance(value, str) else 0


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@given(st.lists(VALUES, max_size=5), st.dictionaries(TEXT, VALUES, max_size=3))
def test_it_yields_what_json_reads(items: list[Any], fields: dict[str, Any]) -> None:
    fields.pop("items", None)
    body = {**fields, "items": items}
    read_items, read_fields = _read(body, Limits(max_depth=64))
    assert read_items == items
    assert read_fields == fields


@given(st.lists(VALUES, min_size=1, max_size=4), st.integers(1, 30), st.integers(0, 60))
def test_an_item_is_refused_exactly_past_its_limits(
    items: list[Any], max_values: int, max_chars: int
) -> None:
    limits = Limits(max_depth=64, max_values=max_values, max_chars=max_chars)
    over = [
        k
        for k, item in enumerate(items)
        if _counts(item)[0] > max_values or _counts(item)[1] > max_chars
    ]
    if not over:
        assert _read({"items": items}, limits)[0] == items
        return
    with pytest.raises(InputError) as refused:
        _read({"items": items}, limits)
    assert refused.value.code == "item_too_large"
    assert refused.value.param == f"items[{over[0]}]"


@given(st.lists(VALUES, min_size=1, max_size=4), st.integers(2, 6))
def test_nesting_is_refused_exactly_past_the_depth(items: list[Any], max_depth: int) -> None:
    # The body's object is level 1 and the items array level 2: an item's own object is 3.
    deepest = max(2 + _depth(item) for item in items)
    limits = Limits(max_depth=max_depth)
    if deepest <= max_depth:
        assert _read({"items": items}, limits)[0] == items
        return
    with pytest.raises(InputError) as refused:
        _read({"items": items}, limits)
    assert refused.value.code == "too_deep"


@given(VALUES, TEXT, st.integers(0, 3))
def test_a_duplicate_key_is_refused_at_any_depth(value: Any, key: str, depth: int) -> None:
    member = json.dumps(key)
    inner = f"{{{member}: {json.dumps(value)}, {member}: 1}}"
    for _ in range(depth):
        inner = f'{{"x": {inner}}}'
    body = f'{{"items": [{inner}]}}'.encode()
    with pytest.raises(InputError) as refused:
        list(read_body(io.BytesIO(body), Limits(max_depth=64)))
    assert refused.value.code == "duplicate_key"
    assert refused.value.param == "items[0]" + ".x" * depth + f".{key[:64]}"


@given(st.sampled_from(["model", "params", "metadata", "items"]), VALUES)
def test_a_duplicate_key_of_the_body_itself_is_refused(key: str, value: Any) -> None:
    # The body's own keys are the one level whose duplicates a set of seen keys finds.
    body = f'{{{json.dumps(key)}: {json.dumps(value)}, "x": 1, {json.dumps(key)}: 2}}'
    if key == "items":
        body = '{"items": [], "x": 1, "items": []}'
    with pytest.raises(InputError) as refused:
        list(read_body(io.BytesIO(body.encode()), Limits(max_depth=64)))
    assert refused.value.code == "duplicate_key" and refused.value.param == key


@given(st.lists(VALUES, min_size=1, max_size=3), st.integers(0, 2), st.booleans())
def test_nul_is_refused_in_any_string_or_key(items: list[Any], where: int, in_key: bool) -> None:
    bad = {"a\x00b": 1} if in_key else {"k": "a\x00b"}
    items = [*items[:where], bad, *items[where:]]
    at = min(where, len(items) - 1)
    with pytest.raises(InputError) as refused:
        _read({"items": items}, Limits(max_depth=64))
    assert "NUL" in refused.value.message
    assert refused.value.param == (f"items[{at}]" if in_key else f"items[{at}].k")


@given(st.integers(0, 6), st.integers(1, 4))
def test_messages_are_refused_exactly_past_their_limit(count: int, limit: int) -> None:
    item = {"messages": [{"role": "user", "content": "x"}] * count}
    limits = Limits(max_depth=64, max_messages=limit)
    if count <= limit:
        assert _read({"items": [item]}, limits)[0] == [item]
        return
    with pytest.raises(InputError) as refused:
        _read({"items": [item]}, limits)
    assert refused.value.code == "too_many_messages"
    assert refused.value.param == "items[0].messages"
