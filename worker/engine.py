"""What the runner needs from an inference engine, and the registry of engines.

`vllm` is the real one (`worker/vllm_engine.py`, the only module that imports vLLM); `fake` is a
deterministic pure-Python engine for fast tests and fault injection. Both batch continuously:
`generate` is called for many items at once and each call returns when its item is done.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any
from typing import Protocol

from thinkbatch.errors import RejectionCode
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings


class EngineDead(Exception):
    """The engine cannot serve any more requests; the process must release its items and exit."""


class AdapterError(Exception):
    """A LoRA adapter of LORA_ADAPTERS cannot be served: the worker must not start."""


class ItemRejected(Exception):
    """This item can never succeed on this engine (e.g. its prompt is longer than the context)."""

    def __init__(self, code: RejectionCode, message: str):
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
    answer_only: bool = False  # the output has no thinking to wait for (a raw prompt)
    # Stop strings the adapter finds in the answer itself, the engine having none of them, as
    # the answer arrives (worker/answer_stops.py): an item that may think.
    answer_stops: tuple[str, ...] = ()
    # The engine's own handle of the adapter the item runs on (vLLM: its LoRARequest); None:
    # the base model.
    adapter: Any = None


@dataclass(slots=True)  # not frozen: one per item (see ledger.Claimed)
class Generation:
    """One choice of an item's output; `more` holds the item's other choices (`n` > 1), each
    with its own tokens and finish reason. `logprobs`, when the item asked for them, has one
    entry per token of `token_ids` in OpenAI's shape (`token`, `logprob`, `bytes`,
    `top_logprobs`)."""

    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    logprobs: list[dict[str, Any]] | None = None
    more: list[Generation] | None = None
    # What of the request ended it, with finish_reason "stop": one of its stop strings, or one
    # of its stop_token_ids; None: the model ended it (EOS), or another finish reason.
    stop_reason: str | int | None = None

    def choices(self) -> list[Generation]:
        return [self, *(self.more or ())]


def token_logprob(raw: bytes, logprob: float) -> dict[str, Any]:
    """One token's log probability in OpenAI's shape, from the bytes the token stands for. A
    token that holds only part of a multi-byte character has no text of its own: its `token` is
    spelled `bytes:\\xNN...` as OpenAI spells it, and its `bytes` are its own, so that joining
    the tokens' bytes gives the text's (a decoded U+FFFD would give other bytes, and make every
    such token the same key of a completion's top_logprobs)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What bounds an item's prompt tokens from below, recorded with the worker so that the API
    refuses at submit an item that cannot fit (thinkbatch/jobs/context.py): the context, the most
    bytes of text one token stands for, and the fewest tokens the chat template adds for one
    message (0 when that cannot be measured)."""

    max_model_len: int
    token_bytes_max: int
    message_tokens_min: int


def widest_token_bytes(decode_batch: Callable[[list[list[int]]], list[str]], size: int) -> int:
    """The most bytes of text any one token id stands for, each id decoded on its own. A
    partial UTF-8 sequence decodes to replacement characters, never to fewer bytes than it
    stands for, so this is an upper bound."""
    widest = 1
    step = 4096
    for start in range(0, size, step):
        texts = decode_batch([[i] for i in range(start, min(size, start + step))])
        widest = max(widest, *(len(text.encode("utf-8", "replace")) for text in texts))
    return widest


def message_tokens_min(count: Callable[[list[dict[str, str]]], int]) -> int:
    """The fewest tokens one more message adds to a rendered conversation, by role, measured
    with empty contents: `count` renders and tokenizes messages. 0 if any rendering fails (a
    template may refuse a shape), which leaves the bound sound, only weaker."""
    fewest: int | None = None
    try:
        for role in ("system", "user", "assistant"):
            one = count([{"role": role, "content": ""}])
            two = count([{"role": role, "content": ""}] * 2)
            fewest = two - one if fewest is None else min(fewest, two - one)
    except Exception:  # noqa: BLE001 - any template error: no bound from the template
        return 0
    return max(0, fewest or 0)


@dataclass(frozen=True, slots=True)
class ThinkTokens:
    start_id: int | None
    end_id: int | None
    turn_start_id: int | None


@dataclass(slots=True)
class SpeculativeStats:
    """Speculative decoding since the engine started, summed over its steps (vLLM's spec-decode
    metrics). Acceptance rate: accepted / drafted tokens. Acceptance length: tokens produced
    per verification step (1 + accepted / drafts), the speed-up bound a draft buys."""

    method: str
    num_speculative_tokens: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        self.drafts += drafts
        self.draft_tokens += draft_tokens
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < len(per_pos):
            self.accepted_per_position += [0] * (len(per_pos) - len(self.accepted_per_position))
        for i, n in enumerate(per_pos):
            self.accepted_per_position[i] += n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None

    @property
    def acceptance_length(self) -> float | None:
        return 1 + self.accepted_tokens / self.drafts if self.drafts else None

    def as_dict(self) -> dict[str, object]:
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_length": self.acceptance_length,
        }

    def summary(self) -> str:
        rate, length = self.acceptance_rate, self.acceptance_length
        return (
            f"speculative decoding ({self.method}, k={self.num_speculative_tokens}): "
            f"{self.accepted_tokens}/{self.draft_tokens} draft tokens accepted "
            f"({(rate or 0):.1%}) over {self.drafts} drafts, mean acceptance length "
            f"{(length or 0):.2f}, accepted per position {self.accepted_per_position}"
        )


@dataclass(frozen=True, slots=True)
class SchedulerLoad:
    """The engine scheduler's state at its last step: requests waiting for a slot, requests
    running, and the fraction of the KV cache in use (0-1). And since the engine started: the
    steps it ran and the requests each ran summed, whose ratio over any interval is the mean
    batch the engine ran (is it kept full?). And the prompt tokens its prefix cache was asked
    for and those it held, whose ratio is its hit rate. With several data-parallel engines in
    one worker the counts are their sums and the gauges the last engine's to report."""

    waiting: int
    running: int
    kv_cache_usage: float
    steps: int = 0
    step_requests: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0


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

    def speculative_stats(self) -> SpeculativeStats | None:
        """Speculative decoding figures since start (None when speculation is off)."""

    def scheduler_load(self) -> SchedulerLoad | None:
        """The scheduler's load at its last step (None before the first step)."""

    def shape(self) -> ModelShape:
        """The served model's context and the bounds of its tokenizer (after start)."""

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
    engine: Engine = cls(settings)
    return engine
