from __future__ import annotations

from thinkbatch.sampling import resolve_sampling


def test_item_overrides_job_and_mode_defaults_apply() -> None:
    s = resolve_sampling(
        {"temperature": 0.1, "max_tokens": 50, "stop": "END"},
        {"enable_thinking": False, "max_tokens": 7},
        default_max_tokens=100,
    )
    assert (s.temperature, s.max_tokens, s.enable_thinking, s.stop) == (0.1, 7, False, ("END",))
    # Unset values follow Qwen3's recommendation for the mode (non-thinking here).
    assert (s.top_p, s.top_k) == (0.8, 20)


def test_thinking_defaults() -> None:
    s = resolve_sampling(None, None, default_max_tokens=100)
    assert (s.enable_thinking, s.temperature, s.top_p, s.top_k, s.max_tokens) == (
        True,
        0.6,
        0.95,
        20,
        100,
    )
