"""A schema's references, checked at submit (thinkbatch/schema_refs.py) and, for what was stored
before, where the worker checks an answer (thinkbatch/answers.py): only pointers into the
schema, leading to a schema, without a loop that never reaches into the value; nothing is ever
fetched; and an answer whose check fails in any way fails its own item, never the writer."""

from __future__ import annotations

import http.server
import json
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from thinkbatch.answers import AnswerInvalid
from thinkbatch.answers import parse_answer
from thinkbatch.ledger import Claimed
from thinkbatch.ledger import Done
from thinkbatch.sampling import resolve_sampling
from thinkbatch.schema_refs import ref_problem
from worker.engine import Generation
from worker.engine import Prepared
from worker.engine import ThinkTokens
from worker.runner import writer as writer_module
from worker.runner.window import Flight
from worker.runner.writer import Outcome
from worker.runner.writer import OutcomeKind
from worker.runner.writer import sort_outcomes

NODE = {
    "type": "object",
    "properties": {
        "value": {"type": "integer"},
        "children": {"type": "array", "items": {"$ref": "#"}},
    },
}
PYDANTIC = {  # what pydantic's model_json_schema writes for a model with a nested model
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}}},
    "type": "object",
    "properties": {"home": {"$ref": "#/$defs/Address"}, "work": {"$ref": "#/$defs/Address"}},
}

ACCEPTED: list[Any] = [
    {"type": "object"},
    {},
    True,
    NODE,  # recursion through items: each step reaches into the value
    PYDANTIC,
    {"$defs": {"a b": {"type": "string"}}, "$ref": "#/$defs/a b"},  # a name with a space
    {"enum": [{"$ref": "http://x"}]},  # a value, not a reference
    {"const": {"$ref": "#/nowhere"}},
    {"$id": "https://example.com/root", "$ref": "#/$defs/x", "$defs": {"x": {}}},  # at the root
    {"$defs": {"list": {"type": "object", "properties": {"next": {"$ref": "#/$defs/list"}}}},
     "$ref": "#/$defs/list"},
]  # fmt: skip

REFUSED: list[tuple[Any, str]] = [
    ({"$ref": "#"}, "reference loop"),
    ({"allOf": [{"$ref": "#"}]}, "reference loop"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"anyOf": [{"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "reference loop"),
    ({"properties": {"x": {"not": {"$ref": "#/properties/x"}}}}, "reference loop"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"properties": {"x": {"$ref": "#/properties/x/type"}, "y": {"type": "string"}}},
     "points at nothing"),
    ({"properties": {"x": {"type": "string"}, "y": {"$ref": "#/properties/x/type"}}},
     "not a schema"),
    ({"$ref": "http://169.254.169.254/latest"}, "not a reference within the schema"),
    ({"$ref": "other.json#/x"}, "not a reference within the schema"),
    ({"$ref": "#anchor"}, "anchor"),
    ({"$dynamicRef": "#meta"}, "anchor"),
    ({"properties": {"x": {"$id": "x.json", "type": "string"}}}, "nested $id"),
    ({"$ref": 5}, "not a reference within the schema"),
    # Valid JSON pointers the engine's grammar compiler cannot follow (it does not unescape).
    ({"$defs": {"a b": {"type": "string"}}, "$ref": "#/$defs/a%20b"}, "escaped"),
    ({"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"}, "escaped"),
]  # fmt: skip


@pytest.mark.parametrize("schema", ACCEPTED, ids=range(len(ACCEPTED)))
def test_references_inside_the_schema_are_accepted(schema: Any) -> None:
    assert ref_problem(schema) is None
    if isinstance(schema, dict):  # and the engine's grammar compiler follows them too
        xgrammar = pytest.importorskip("xgrammar")
        xgrammar.Grammar.from_json_schema(json.dumps(schema))


@pytest.mark.parametrize(("schema", "words"), REFUSED, ids=range(len(REFUSED)))
def test_what_cannot_be_followed_safely_is_refused(schema: Any, words: str) -> None:
    why = ref_problem(schema)
    assert why is not None and words in why, why


@pytest.fixture
def listener() -> Iterator[tuple[str, list[str]]]:
    """A loopback HTTP server that records every path asked of it."""
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"type": "integer"}')

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="schema-listener")
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _json_sampling(schema: Any) -> Any:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    return resolve_sampling({"response_format": fmt}, None, default_max_tokens=8)


def test_checking_an_answer_never_fetches_a_reference(listener: tuple[str, list[str]]) -> None:
    url, asked = listener
    # As if stored before the submit refused such references.
    sampling = _json_sampling({"$ref": f"{url}/schema.json"})
    with pytest.raises(AnswerInvalid, match="could not be checked"):
        parse_answer("5", sampling, "call")
    assert asked == []


@pytest.mark.parametrize("schema", [{"$ref": "#"}, {"$ref": "#/$defs/missing"}])
def test_a_schema_that_cannot_be_checked_makes_the_answer_invalid(schema: Any) -> None:
    with pytest.raises(AnswerInvalid, match="could not be checked"):
        parse_answer("{}", _json_sampling(schema), "call")


def test_an_empty_schema_allows_any_json_value() -> None:
    sampling = _json_sampling({})
    assert sampling.structured.schema == {}
    assert parse_answer("[1, 2]", sampling, "call").is_json
    # Without a schema, the answer must be an object.
    fmt = {"type": "json_schema", "json_schema": {"name": "x"}}
    bare = resolve_sampling({"response_format": fmt}, None, default_max_tokens=8)
    with pytest.raises(AnswerInvalid):
        parse_answer("[1, 2]", bare, "call")


def _done_outcome(item_id: int, job_id: uuid.UUID) -> Outcome:
    sampling = resolve_sampling(None, None, default_max_tokens=8)
    item = Claimed(item_id, job_id, item_id, f"c{item_id}", None, "p", None, 1, 0)
    prepared = Prepared(prompt_ids=[5], opened_in_prompt=False, sampling=sampling)
    flight = Flight(claimed=item, prepared=prepared, handle=None, started=0.0)  # type: ignore[arg-type]
    generation = Generation(
        token_ids=[7, 8], text="an answer", finish_reason="stop", prompt_tokens=1
    )
    return Outcome(flight, item, None, OutcomeKind.done, generation=generation)  # type: ignore[arg-type]


def test_a_result_that_cannot_be_built_fails_its_item_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whatever raises while one outcome's result is built, the batch's other results are
    stored and that item is failed (retried), instead of the exception ending the writer."""
    job_id = uuid.uuid4()
    real = writer_module.to_done

    def to_done(item: Claimed, *args: Any) -> Any:
        if item.id == 2:
            raise RecursionError("maximum recursion depth exceeded")
        return real(item, *args)

    monkeypatch.setattr(writer_module, "to_done", to_done)
    batch = [_done_outcome(k, job_id) for k in (1, 2, 3)]
    writes = sort_outcomes(batch, think=ThinkTokens(None, None, None), item_deadline_s=60)
    assert [d.item_id for d in writes.done] == [1, 3]
    assert all(isinstance(d, Done) for d in writes.done)
    [failed] = writes.failed
    assert (failed.item_id, failed.code, failed.retryable) == (2, "internal_error", True)
    assert "RecursionError" in failed.message
