"""The one table of sampling limits: what the API accepts for each sampling parameter.

`SamplingParamsIn` (schemas) is built from this table, and tests/unit/test_sampling_limits.py checks
every bound against vLLM's own `SamplingParams` at the boundary (just inside, just outside), so
the API cannot accept a value the engine would refuse, or silently change. A bound marked
`engine` is vLLM's rule (`SamplingParams._verify_args`); one marked `api` is ours, stricter than
the engine's, and says why. This module must not import vllm (only worker/vllm_engine.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import Literal

from pydantic import Field

INT64_MAX = 2**63 - 1  # the JSON parser refuses larger integers; the engine's transport too
Source = Literal["engine", "api"]


@dataclass(frozen=True, slots=True)
class Bound:
    value: float
    inclusive: bool
    source: Source
    why: str = ""


@dataclass(frozen=True, slots=True)
class Limit:
    name: str
    kind: type  # int or float
    low: Bound | None
    high: Bound | None
    description: str
    # vLLM raises a float in (0, min_nonzero) to min_nonzero with only a log warning: refuse it.
    min_nonzero: float | None = None
    # A parameter the engine knows by another name or counts differently: its SamplingParams
    # name and the value it is given (tests check the bounds through this mapping).
    engine_name: str | None = None
    to_engine: Callable[[Any], Any] | None = None

    def engine(self, value: Any) -> tuple[str, Any]:
        """(name, value) of this parameter in vLLM's SamplingParams."""
        mapped = self.to_engine(value) if self.to_engine is not None else value
        return self.engine_name or self.name, mapped

    def field(self) -> Any:
        """The pydantic Field of this parameter (optional, None when absent)."""
        bounds: dict[str, float] = {}
        if self.low is not None:
            bounds["ge" if self.low.inclusive else "gt"] = self.low.value
        if self.high is not None:
            bounds["le" if self.high.inclusive else "lt"] = self.high.value
        extra = {"allow_inf_nan": False} if self.kind is float else {}
        # pydantic's Field overloads cannot see through **kwargs; the keys are its own.
        kwargs: dict[str, Any] = {**bounds, **extra}
        return Field(None, description=self.description, **kwargs)

    def range_text(self) -> str:
        """`a number >= 0 and <= 2`, `an integer >= 1 and <= 9223372036854775807`."""
        parts = []
        for bound, signs in ((self.low, (">=", ">")), (self.high, ("<=", "<"))):
            if bound is not None:
                shown = f"{bound.value:g}" if self.kind is float else str(int(bound.value))
                parts.append(f"{signs[0] if bound.inclusive else signs[1]} {shown}")
        noun = "a number" if self.kind is float else "an integer"
        return f"{noun} {' and '.join(parts)}"


SAMPLING_LIMITS: dict[str, Limit] = {
    limit.name: limit
    for limit in (
        Limit(
            "max_tokens",
            int,
            Bound(1, True, "engine"),
            # The deployment's cap (MAX_TOKENS_CAP) is checked against Settings in jobs.py.
            Bound(INT64_MAX, True, "api", "64-bit integers; MAX_TOKENS_CAP applies on top"),
            "Most tokens to generate (thinking and answer together); at most MAX_TOKENS_CAP.",
        ),
        Limit(
            "temperature",
            float,
            Bound(0.0, True, "engine"),
            Bound(2.0, True, "engine"),
            "0 is greedy; otherwise between 0.01 and 2.",
            min_nonzero=0.01,
        ),
        Limit(
            "top_p",
            float,
            Bound(0.0, False, "engine"),
            Bound(1.0, True, "engine"),
            "Nucleus sampling mass, in (0, 1].",
        ),
        Limit(
            "top_k",
            int,
            Bound(-1, True, "engine"),
            Bound(INT64_MAX, True, "api", "64-bit integers"),
            "Top-k sampling; -1 or 0 disables it.",
        ),
        Limit(
            "seed",
            int,
            # vLLM reads seed -1 as "no seed": a negative seed would silently be something else.
            Bound(0, True, "api", "vLLM treats -1 as no seed at all"),
            Bound(INT64_MAX, True, "api", "torch generators take 64-bit seeds"),
            "Seed of this item's sampling, 0 to 2^63-1.",
        ),
        Limit(
            "presence_penalty",
            float,
            Bound(-2.0, True, "engine"),
            Bound(2.0, True, "engine"),
            "Penalty for tokens already present, in [-2, 2].",
        ),
        Limit(
            "frequency_penalty",
            float,
            Bound(-2.0, True, "engine"),
            Bound(2.0, True, "engine"),
            "Penalty by how often a token already appeared, in [-2, 2].",
        ),
        Limit(
            "repetition_penalty",
            float,
            # vLLM's rule is > 0, but the engine divides float32 logits by it: 1e-300 is 0 in
            # float32 and 1e-38 overflows a logit to inf, and either makes the probabilities
            # NaN (an item that "succeeds" with garbage).
            Bound(0.01, True, "api", "below 0.01 the engine's float32 logits overflow to NaN"),
            Bound(10.0, True, "api", "beyond 10 the output is noise; a typo guard"),
            "Repetition penalty, in [0.01, 10]; 1 is none, below 1 favours repeats.",
        ),
        Limit(
            "n",
            int,
            Bound(1, True, "engine"),
            Bound(128, True, "api", "a typo guard; MAX_CHOICES applies on top"),
            "Choices to generate for the item, each with its own thinking and answer; at most "
            "MAX_CHOICES.",
        ),
        Limit(
            "min_p",
            float,
            Bound(0.0, True, "engine"),
            Bound(1.0, True, "engine"),
            "Drop tokens below this fraction of the likeliest token's probability, in [0, 1].",
        ),
        Limit(
            "top_logprobs",
            int,
            # vLLM reads -1 as "the whole vocabulary": megabytes per token.
            Bound(0, True, "api", "vLLM reads -1 as the whole vocabulary"),
            Bound(20, True, "api", "OpenAI's bound, and vLLM's default max_logprobs"),
            "Most likely alternatives returned per answer token, 0 to 20; needs logprobs: true.",
            engine_name="logprobs",
        ),
        Limit(
            "thinking_budget",
            int,
            # 0 would be no thinking at all: that is enable_thinking=false, said plainly.
            Bound(1, True, "api", "no thinking at all is enable_thinking=false"),
            Bound(INT64_MAX, True, "api", "64-bit integers; below max_tokens applies on top"),
            "Most tokens the model may think (the opening <think> included) before the engine "
            "closes the thinking block; it then answers within the rest of max_tokens. Below "
            "the item's max_tokens. Ignored when enable_thinking is false.",
            # vLLM counts the tokens after <think>; ours count <think> too, as
            # usage.reasoning_tokens does, so reasoning_tokens <= thinking_budget + 1 (</think>).
            engine_name="thinking_token_budget",
            to_engine=lambda budget: budget - 1,
        ),
    )
}

# Stop strings: vLLM refuses an empty one ("stop cannot contain an empty string"); the count
# and length caps are ours (the engine holds back len(longest stop) - 1 characters of output).
STOP_MAX_STRINGS = 16
STOP_MAX_CHARS = 256

# logit_bias: OpenAI's value range (vLLM's OpenAI server clamps to it); the entry count is ours.
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 1024
# stop_token_ids: token ids are checked against the vocabulary by the engine (the item fails
# as invalid_request); the count is ours.
STOP_TOKEN_IDS_MAX = 64
# tools: OpenAI's limit of functions per request.
TOOLS_MAX = 128


def range_text(name: str) -> str | None:
    limit = SAMPLING_LIMITS.get(name)
    return limit.range_text() if limit else None
