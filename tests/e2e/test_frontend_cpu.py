"""The worker's cheaper ways through the engine's frontend give the same results as the ways
they replace: token ids straight from the Rust tokenizer, and a garbage collector that no
longer walks the start-up heap."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from tests.stacks import build_demo_model

TEXTS = [
    "",
    "plain text",
    "Round 3, question 17: explain continuous batching.",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<think>a thought</think>the answer",
    "unicode: naïve café 東京 🙂 \u200b tabs\tand\nnewlines",
    "x" * 5000,
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The demo checkpoint's tokenizer as vLLM hands it to the worker (its cached wrapper)."""
    build_demo_model()
    from vllm.tokenizers import get_tokenizer

    from devstack.tiny_model import DEFAULT_DIR

    return get_tokenizer(str(DEFAULT_DIR))


@pytest.mark.slow
@pytest.mark.parametrize("special", [False, True])
def test_encode_ids_are_the_tokenizers_input_ids(tokenizer: Any, special: bool) -> None:
    from worker.vllm_engine import encode_ids

    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        for text in TEXTS
        for thinking in (True, False)
    ]
    texts = TEXTS + chat
    expected = [list(ids) for ids in tokenizer(texts, add_special_tokens=special).input_ids]
    got = encode_ids(tokenizer, texts, special)
    assert got == expected
    assert all(type(ids) is list and all(type(t) is int for t in ids) for ids in got)


@pytest.mark.slow
def test_a_tokenizer_without_a_rust_backend_is_called_as_before(tokenizer: Any) -> None:
    from worker.vllm_engine import encode_ids

    class Slow:
        """A tokenizer that can only be called (no `backend_tokenizer`)."""

        def __call__(self, texts: list[str], add_special_tokens: bool) -> Any:
            return tokenizer(texts, add_special_tokens=add_special_tokens)

    assert encode_ids(Slow(), TEXTS, False) == encode_ids(tokenizer, TEXTS, False)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_a_ready_worker_freezes_its_start_up_heap(
    unfrozen: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from worker import lifecycle

    gc.unfreeze()
    monkeypatch.setattr(lifecycle, "_runner", None)
    lifecycle.freeze_heap()
    assert gc.get_freeze_count() == 0  # no engine loaded: nothing to keep out of reach

    monkeypatch.setattr(lifecycle, "_runner", object())
    kept = [[i] for i in range(1000)]  # start-up objects, tracked by the collector
    lifecycle.freeze_heap()
    assert gc.get_freeze_count() >= len(kept)
    # A full collection no longer walks them: they left the oldest generation for good.
    oldest = {id(o) for o in gc.get_objects(generation=2)}
    assert not any(id(k) in oldest for k in kept)


@pytest.mark.slow
def test_logprob_bytes_are_each_tokens_own(tokenizer: Any) -> None:
    """Tokens inside a multi-byte character carry their own bytes, read from the byte-level
    vocabulary, not the bytes of the U+FFFD they decode to: joined, they are the text's."""
    from worker.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.tokenizer = tokenizer
    engine._backend = tokenizer.backend_tokenizer
    text = TEXTS[5]
    ids = tokenizer(text, add_special_tokens=False).input_ids
    entries = [engine._token_entry(i, -1.0) for i in ids]
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    halves = [e for e in entries if e["token"].startswith("bytes:")]
    assert halves, "the demo vocabulary splits some character of the text"
    assert all("\ufffd" not in e["token"] for e in entries)
    assert len({e["token"] for e in halves}) > 1  # not one key for every half-character
