"""The references inside a JSON Schema a request hands us, checked at submit.

A schema is validated twice downstream: compiled into a grammar by the engine, and checked
against the answer by the worker (thinkbatch/answers.py). A reference both would follow must
stay inside the schema and lead somewhere:
- only a JSON pointer into the schema itself (`#`, `#/$defs/name`) is accepted. Any other
  reference (a URL, a file name, an anchor) would have the worker fetch it or fail to: a
  request could make our hosts send requests for it;
- a pointer must lead to a schema (an object or a boolean) in the document;
- a loop of references that never reaches into the value (`{"$ref": "#"}`, or two
  definitions that refer to each other through `allOf`) never ends: a validator recurses
  until the interpreter's limit. A loop that passes through `properties`, `items` or any other
  keyword that reaches into the value is the ordinary recursive schema (a tree, a linked list)
  and is fine: each step consumes part of a finite answer;
- a nested `$id` would change what its pointers are relative to; it is refused rather than
  followed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# Keywords whose value is a schema applied to the same value as the schema holding them (in
# place), and those that reach into the value (an element, a property) or only hold
# definitions. A loop through in-place keywords and references alone never ends.
_IN_PLACE_ONE = ("not", "if", "then", "else")
_IN_PLACE_MANY = ("allOf", "anyOf", "oneOf")
_IN_PLACE_MAP = ("dependentSchemas",)
_INTO_ONE = (
    "items",
    "additionalItems",
    "contains",
    "additionalProperties",
    "propertyNames",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
_INTO_MANY = ("prefixItems", "items")
_INTO_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependencies")
_REFS = ("$ref", "$dynamicRef", "$recursiveRef")


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _children(node: dict[str, Any], at: str) -> Iterator[tuple[str, Any, bool]]:
    """(pointer, subschema, in place) of each subschema `node` holds."""
    for key in _IN_PLACE_ONE + _INTO_ONE:
        value = node.get(key)
        if isinstance(value, dict | bool):
            yield f"{at}/{_escape(key)}", value, key in _IN_PLACE_ONE
    for key in _IN_PLACE_MANY + _INTO_MANY:
        value = node.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                if isinstance(sub, dict | bool):
                    yield f"{at}/{_escape(key)}/{i}", sub, key in _IN_PLACE_MANY
    for key in _IN_PLACE_MAP + _INTO_MAP:
        value = node.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                # `dependencies` holds a schema or a list of property names per property, and
                # a schema there applies to the same value (draft 7's dependentSchemas).
                if isinstance(sub, dict | bool):
                    in_place = key in _IN_PLACE_MAP or key == "dependencies"
                    yield f"{at}/{_escape(key)}/{_escape(str(name))}", sub, in_place


def resolve(root: Any, pointer: str) -> Any:
    """The value at a JSON pointer (already without its leading '#'), or a KeyError."""
    node = root
    if pointer == "":
        return node
    if not pointer.startswith("/"):
        raise KeyError(pointer)
    for raw in pointer[1:].split("/"):
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            raise KeyError(pointer)
    return node


def ref_problem(schema: Any) -> str | None:
    """Why the references of `schema` cannot be followed safely (see the module), or None."""
    if not isinstance(schema, dict):
        return None
    # Every subschema by pointer, with its edges: the in-place ones (children applied to the
    # same value, and the target of its reference) are those a loop must not close over.
    # Drafts 3 and 4 spell $id `id`, a word that is a keyword there and nothing in later drafts.
    draft4 = any(f"draft-0{n}" in str(schema.get("$schema", "")) for n in (3, 4))
    nodes: dict[str, dict[str, Any]] = {}
    in_place: dict[str, list[str]] = {}
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        at, node = stack.pop()
        if at in nodes or not isinstance(node, dict):
            continue
        nodes[at] = node
        edges = in_place.setdefault(at, [])
        if at and ("$id" in node or (draft4 and isinstance(node.get("id"), str))):
            return f"{at}: a nested $id is not supported; refer to #/$defs/... instead"
        for key in _REFS:
            ref = node.get(key)
            if ref is None:
                continue
            where = f"{at}/{_escape(key)}"
            if not isinstance(ref, str) or not ref.startswith("#"):
                return (
                    f"{where}: {ref!r} is not a reference within the schema; only '#' and "
                    f"'#/...' pointers are supported"
                )
            if "%" in ref or "~" in ref:
                # Valid JSON pointers, but the engine's grammar compiler (xgrammar) neither
                # unquotes nor unescapes them: the item could only fail at the worker.
                return (
                    f"{where}: {ref!r} is escaped ('%' or '~'); the engine's grammar compiler "
                    f"follows only plain pointers: rename the definition"
                )
            pointer = unquote(ref[1:])
            if pointer and not pointer.startswith("/"):
                return f"{where}: {ref!r} names an anchor; only '#/...' pointers are supported"
            try:
                target = resolve(schema, pointer)
            except KeyError:
                return f"{where}: {ref!r} points at nothing in the schema"
            if not isinstance(target, dict | bool):
                return f"{where}: {ref!r} points at a {type(target).__name__}, not a schema"
            edges.append(pointer)
            stack.append((pointer, target))
        for child_at, child, same_value in _children(node, at):
            if same_value:
                edges.append(child_at)
            stack.append((child_at, child))
    return _loop(in_place)


def _loop(in_place: dict[str, list[str]]) -> str | None:
    """A cycle of in-place edges, described, or None (an iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in in_place:
        if state.get(start):
            continue
        path = [start]
        state[start] = 1
        iters = [iter(in_place.get(start, ()))]
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(nxt) == 1:
                loop = path[path.index(nxt) :] + [nxt]
                shown = " -> ".join("#" + p for p in loop)
                return f"a reference loop that never reaches into the value: {shown}"
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(in_place.get(nxt, ())))
    return None


def rehomed(schema: Any, base: str) -> Any:
    """A copy of `schema` to be placed at the JSON pointer `base` of a larger schema, its
    references rewritten to point where their targets now are (`#/$defs/a` becomes
    `#<base>/$defs/a`, `#` becomes `#<base>`). Only references in schema positions are touched;
    a `const` or `enum` value that happens to hold a `$ref` key is data, and stays as sent.
    The references were checked by `ref_problem` at submit: each is a `#` pointer."""
    copy = json.loads(json.dumps(schema))
    if isinstance(copy, dict):
        # A root `$id` would make the moved pointers relative to it, where they lead nowhere
        # (the answer's check fails); there is no nested one (`ref_problem` refuses those). A
        # draft-04 `id` is the same keyword, and an unknown one in later drafts.
        copy.pop("$id", None)
        if isinstance(copy.get("id"), str):
            copy.pop("id")
    stack: list[Any] = [copy]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in _REFS:
            ref = node.get(key)
            if isinstance(ref, str) and ref.startswith("#"):
                node[key] = "#" + base + ref[1:]
        stack.extend(child for _, child, _ in _children(node, ""))
    return copy


# Keywords the engine's grammar compiler (xgrammar) compiles as if they were absent: a grammar
# of such a schema lets through answers that break it, which the worker's check then fails as
# answer_invalid, attempt after attempt (measured on xgrammar 0.2.8: `{"not": {"type":
# "string"}}` accepts "x"; `dependentRequired` accepts `{"a": 1}` without its `b`).
UNHELD_KEYWORDS = ("not", "dependentRequired", "dependentSchemas", "dependencies")


def unheld_problem(schema: Any) -> str | None:
    """The first keyword of `schema`'s subschemas that the engine's grammar cannot hold the
    answer to (UNHELD_KEYWORDS), by pointer, or None. Only subschemas are read: a property
    named `not`, or a `const` holding one, is data, not the keyword."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        at, node = stack.pop()
        if not isinstance(node, dict):
            continue
        for key in UNHELD_KEYWORDS:
            if key in node:
                return (
                    f"{at}/{key}: the engine's grammar compiler does not enforce {key!r} (it "
                    "would let answers that break it through); express it without the keyword"
                )
        stack.extend((child_at, child) for child_at, child, _ in _children(node, at))
    return None
