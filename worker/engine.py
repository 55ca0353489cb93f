"""What the runner needs from an inference engine, and the registry of engines.

`vllm` is the real one (`worker/vllm_engine.py`, the only module that imports vLLM); `fake` is a
deterministic pure-Python engine for fast tests and fault injection. Both batch continuously:
`generate` is called for many items at once and each call returns when its item is done.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from typing import Protocol

from thinkbatch.ledger import Claimed
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings


class EngineDead(Exception):
    """The engine cannot serve any more requests; the process must release its items and exit."""


class ItemRejected(Exception):
    """This item can never succeed on this engine (e.g. its prompt is longer than the context)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Prepared:
    """An item rendered and tokenized, ready for `generate` (built off the event loop)."""

    prompt_ids: list[int]
    opened_in_prompt: bool
    sampling: Sampling
    native: Any = None  # the engine's own request parameters, prebuilt


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    start_id: int | None
    end_id: int | None
    turn_start_id: int | None


class Engine(Protocol):
    think: ThinkTokens

    async def start(self) -> None:
        """Load the model. Runs on the runner's event loop."""

    def prepare(
        self, items: Sequence[Claimed], sampling: Sequence[Sampling]
    ) -> list[Prepared | ItemRejected]:
        """Render chat templates and tokenize (thread-safe; called off the event loop)."""

    async def generate(self, request_id: str, prepared: Prepared) -> Generation:
        """Run one item to completion. Cancelling the awaiting task aborts the request."""

    async def shutdown(self) -> None:
        """Stop the engine and its processes."""


_ENGINES = {
    "vllm": ("worker.vllm_engine", "VLLMEngine"),
    "fake": ("worker.fake_engine", "FakeEngine"),
}


def create_engine(settings: Settings) -> Engine:
    """Build the engine named by ENGINE; its module is imported only when chosen."""
    module_name, class_name = _ENGINES[settings.engine]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(settings)
