"""The thinking budget handed to vLLM, checked against vLLM's own count of it (its thinking
budget state, as the engine's sampler builds it), without starting an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from thinkbatch.sampling import resolve_sampling
from worker.engine import ThinkTokens

# imports vLLM (and torch): ~15 s on this host
pytestmark = [pytest.mark.slow, pytest.mark.engine]

START, END, TURN = 151667, 151668, 151644  # Qwen3's <think>, </think>, <|im_start|>


@pytest.mark.parametrize("before", [0, 5, 590])
@pytest.mark.parametrize("after", [[], [198], [198, 42, 43]])
def test_a_prompt_that_opens_the_thinking_leaves_the_model_its_whole_budget(
    before: int, after: list[int]
) -> None:
    """A template that opens <think> itself (a thinking-only model's): the model may still
    write `thinking_budget` tokens of thinking, wherever the <think> stands in the prompt and
    whatever follows it there."""
    import torch
    from vllm.v1.sample.thinking_budget_state import ThinkingBudgetStateHolder

    from worker.vllm_engine import VLLMEngine

    prompt = [1] * before + [TURN, 77091, 198, START, *after]
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.think = ThinkTokens(START, END, TURN)
    sampling = resolve_sampling({"thinking_budget": 100, "max_tokens": 2000}, None,
                                default_max_tokens=4096)  # fmt: skip
    handed = engine._thinking_token_budget(sampling, prompt, True)
    config = SimpleNamespace(reasoning_start_token_ids=[START], reasoning_end_token_ids=[END])
    holder = ThinkingBudgetStateHolder(config, 4, 0, torch.device("cpu"), False)
    state = holder._init_state_entry(prompt, handed)
    assert state["check_count_down"] == 100
