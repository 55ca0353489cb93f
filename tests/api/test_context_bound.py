"""An item that cannot fit the model's context is refused at submit, from the bound the live
workers recorded (thinkbatch/jobs/context.py), and that bound never exceeds a real token count."""

from __future__ import annotations

import json
import string
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.helpers import TENANT
from tests.helpers import keyed_client
from tests.helpers import make_key
from thinkbatch import ledger
from thinkbatch.jobs import ItemIn
from thinkbatch.jobs import Message
from thinkbatch.jobs.context import ContextBound
from thinkbatch.settings import Settings
from worker.engine import message_tokens_min
from worker.engine import widest_token_bytes
from worker.fake_engine import FakeEngine
from worker.fake_engine import encode
from worker.fake_engine import render_chat

BOUND = ContextBound(max_model_len=64, token_bytes_max=4, message_tokens_min=3)


def test_the_floor_of_a_prompt_and_of_messages() -> None:
    assert BOUND.floor(ItemIn(prompt="x" * 9)) == 3  # ceil(9 / 4)
    assert BOUND.floor(ItemIn(prompt="é" * 4)) == 2  # bytes, not characters
    messages = [
        Message(role="system", content="x" * 8),
        Message(role="user", content="x" * 8),
        Message(role="assistant", content="x" * 400),  # a template may drop parts of it
    ]
    # Each content's 2 tokens, less the two it may share with the template around it.
    assert BOUND.floor(ItemIn(messages=messages)) == 0 + 0 + 3 * 3
    long = [Message(role="user", content="x" * 40)]
    assert BOUND.floor(ItemIn(messages=long)) == 10 - 2 + 3
    assert BOUND.refusal(ItemIn(prompt="x" * 252)) is None  # 63 < 64
    assert BOUND.refusal(ItemIn(prompt="x" * 253)) == (
        "at least 64 prompt tokens, and the model's context is 64 tokens"
    )


def _worker(db: sa.Engine, name: str, *, stale: bool = False, **shape: int | None) -> None:
    values = {"max_model_len": 64, "token_bytes_max": 4, "message_tokens_min": 3, **shape}
    with db.begin() as conn:
        ledger.register_worker(
            conn, name, hostname="h", pid=1, model="thinkbatch-demo", dead_after_s=60, **values
        )
        if stale:
            conn.execute(
                sa.text(
                    "UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE id = :w"
                ),
                {"w": name},
            )


def _submit(client: FlaskClient, item: dict[str, object]) -> tuple[int, dict[str, object]]:
    response = client.post("/v1/jobs", json={"items": [{"prompt": "fine"}, item]})
    return response.status_code, response.json or {}


def test_an_item_that_cannot_fit_is_refused_at_submit(client: FlaskClient, db: sa.Engine) -> None:
    _worker(db, "w1")
    status, body = _submit(client, {"prompt": "x" * 253})
    assert status == 400
    error = body["error"]
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == ("items[1].prompt", "prompt_too_long")
    assert "context is 64 tokens" in error["message"]
    many = {"messages": [{"role": "user", "content": ""}] * 22}  # 66 tokens of template
    assert _submit(client, many)[0] == 400
    fits = {"messages": [{"role": "user", "content": ""}] * 21}  # 63
    assert _submit(client, fits)[0] == 201
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 1


def test_the_largest_live_context_decides(client: FlaskClient, db: sa.Engine) -> None:
    _worker(db, "small")
    _worker(db, "large", max_model_len=4096)
    _worker(db, "dead", stale=True, max_model_len=1_000_000)
    assert _submit(client, {"prompt": "x" * 253})[0] == 201
    assert _submit(client, {"prompt": "x" * 4 * 4096})[0] == 400


def test_with_no_live_worker_the_worker_decides(client: FlaskClient, db: sa.Engine) -> None:
    _worker(db, "dead", stale=True)
    _worker(db, "unmeasured", token_bytes_max=None)
    assert _submit(client, {"prompt": "x" * 10_000})[0] == 201


def test_the_fake_engines_shape_is_a_true_floor(settings: Settings) -> None:
    shape = FakeEngine(settings).shape()
    assert shape.max_model_len == settings.max_model_len
    assert shape.token_bytes_max == len("<|endoftext|>")
    empty = len(encode(render_chat([], True)))
    per_role = [
        len(encode(render_chat([{"role": role, "content": ""}], True))) - empty
        for role in ("system", "user", "assistant")
    ]
    assert shape.message_tokens_min == min(per_role)
    # <|im_start|> and <|im_end|> are one token each, every other byte one: 1 + 5 + 1 + 1.
    assert shape.message_tokens_min == 8


def test_message_tokens_min_takes_the_fewest_and_survives_a_template_error() -> None:
    per_role = {"system": 5, "user": 4, "assistant": 6}

    def count(messages: list[dict[str, str]]) -> int:
        return 2 + sum(per_role[m["role"]] for m in messages)

    assert message_tokens_min(count) == 4

    def refuses(messages: list[dict[str, str]]) -> int:
        raise ValueError("this template takes one system message")

    assert message_tokens_min(refuses) == 0


def test_widest_token_bytes_counts_replacement_characters() -> None:
    vocab = ["a", "hello", "\ufffd", "日本"]

    def decode(ids: list[list[int]]) -> list[str]:
        return [vocab[i[0]] for i in ids]

    assert widest_token_bytes(decode, len(vocab)) == 6


TEXT = st.text(
    alphabet=st.sampled_from(string.printable + "日本語の文章です。😀éü\u200b\x7f"), max_size=400
)


@pytest.mark.slow  # the demo model's tokenizer (built once, cached)
def test_the_bound_never_exceeds_the_demo_tokenizers_count() -> None:
    from transformers import PreTrainedTokenizerFast

    from devstack.demo_model import build_demo_model

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(build_demo_model()))
    backend = tokenizer.backend_tokenizer
    vocab = max(tokenizer.get_vocab().values()) + 1

    def decode(ids: list[list[int]]) -> list[str]:
        return list(backend.decode_batch(ids, skip_special_tokens=False))

    def count(messages: list[dict[str, str]]) -> int:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return len(backend.encode(text, add_special_tokens=False).ids)

    bound = ContextBound(1, widest_token_bytes(decode, vocab), message_tokens_min(count))
    assert bound.message_tokens_min >= 1

    @hsettings(max_examples=200, deadline=None)
    @given(prompt=TEXT, contents=st.lists(TEXT, min_size=1, max_size=6))
    def check(prompt: str, contents: list[str]) -> None:
        if prompt:
            real = len(backend.encode(prompt, add_special_tokens=True).ids)
            assert bound.floor(ItemIn(prompt=prompt)) <= real
        messages = [
            {"role": "user" if n % 2 == 0 else "assistant", "content": c}
            for n, c in enumerate(contents)
        ]
        real = count(messages)
        item = ItemIn(messages=[Message.model_validate(m) for m in messages])
        assert bound.floor(item) <= real

    check()


OTHER = "tiny-b"
LONG = {"messages": [{"role": "user", "content": "x" * 400}]}  # at least 100 tokens of 4 bytes


@pytest.mark.parametrize("model_first", [True, False])
def test_an_item_is_bounded_by_the_model_its_job_names(
    make_app: Any, db: sa.Engine, model_first: bool
) -> None:
    """Items that name no model run on the job's: the job's model decides their bound, whether
    the body names it before its items or after them (a streamed body may do either)."""
    _worker(db, "w-small")  # thinkbatch-demo: 64 tokens
    with db.begin() as conn:
        shape = {"max_model_len": 100_000, "token_bytes_max": 4, "message_tokens_min": 3}
        ledger.register_worker(
            conn, "w-big", hostname="h", pid=2, model=OTHER, dead_after_s=60, **shape
        )
    client = keyed_client(make_app(served_models=["thinkbatch-demo", OTHER]), make_key(db, TENANT))

    def submit(model: str) -> Any:
        fields = [("model", model), ("items", [{"prompt": "fine"}, LONG])]
        body = dict(fields if model_first else fields[::-1])
        return client.post("/v1/jobs", data=json.dumps(body), content_type="application/json")

    accepted = submit(OTHER)
    assert accepted.status_code == 201, accepted.json
    refused = submit("thinkbatch-demo")
    assert refused.status_code == 400
    assert (refused.json["error"]["param"], refused.json["error"]["code"]) == (
        "items[1].messages",
        "prompt_too_long",
    )
    assert "context is 64 tokens" in refused.json["error"]["message"]
