"""The speculative decoding figures the worker reports (worker/engine.py SpeculativeStats),
summed from vLLM's per-step spec-decode stats. The engine itself:
tests/e2e/test_reasoning_e2e.py."""

from __future__ import annotations

import pytest

from worker.engine import SpeculativeStats


def test_figures_are_summed_over_steps() -> None:
    stats = SpeculativeStats("ngram", 4)
    assert stats.acceptance_rate is None and stats.acceptance_length is None
    stats.add(2, 8, 5, [2, 2, 1, 0])
    stats.add(1, 4, 4, [1, 1, 1, 1])
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (3, 12, 9)
    assert stats.accepted_per_position == [3, 3, 2, 1]
    assert stats.acceptance_rate == pytest.approx(0.75)
    assert stats.acceptance_length == pytest.approx(4.0)  # 1 + 9 accepted / 3 drafts
    assert stats.as_dict()["acceptance_rate"] == pytest.approx(0.75)
    assert "9/12 draft tokens accepted (75.0%)" in stats.summary()


def test_the_fake_engine_reports_no_speculation() -> None:
    from tests.helpers import make_settings
    from worker.engine import create_engine

    engine = create_engine(make_settings("postgresql://x/y", "redis://x/0"))
    assert engine.speculative_stats() is None
