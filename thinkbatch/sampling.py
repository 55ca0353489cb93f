"""Resolve a job's sampling parameters, one item's overrides and the defaults into one value."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Qwen3's recommended sampling per mode (model card): greedy decoding makes thinking models
# loop, so unset values follow the mode instead of a single global default.
_THINKING_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
_ANSWER_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    enable_thinking: bool
    ignore_eos: bool
    # None with thinking off: the budget is ignored then (documented on the field), not an error.
    thinking_budget: int | None = None


def resolve_sampling(
    job_params: Mapping[str, Any] | None,
    item_params: Mapping[str, Any] | None,
    *,
    default_max_tokens: int,
) -> Sampling:
    merged: dict[str, Any] = {**(job_params or {}), **(item_params or {})}
    thinking = bool(merged.get("enable_thinking", True))
    mode = _THINKING_DEFAULTS if thinking else _ANSWER_DEFAULTS
    stop = merged.get("stop")
    budget = merged.get("thinking_budget") if thinking else None
    return Sampling(
        max_tokens=int(merged.get("max_tokens", default_max_tokens)),
        temperature=float(merged.get("temperature", mode["temperature"])),
        top_p=float(merged.get("top_p", mode["top_p"])),
        top_k=int(merged.get("top_k", mode["top_k"])),
        seed=merged.get("seed"),
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        presence_penalty=float(merged.get("presence_penalty", 0.0)),
        frequency_penalty=float(merged.get("frequency_penalty", 0.0)),
        repetition_penalty=float(merged.get("repetition_penalty", 1.0)),
        enable_thinking=thinking,
        ignore_eos=bool(merged.get("ignore_eos", False)),
        thinking_budget=int(budget) if budget is not None else None,
    )
