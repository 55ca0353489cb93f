"""Settings: read from the environment in one place; timeouts must nest."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from thinkbatch.settings import Settings


def test_defaults_nest() -> None:
    s = Settings(_env_file=None)
    assert s.item_deadline_s < s.lease_s < s.visibility_timeout_s
    assert s.task_slice_s + s.item_deadline_s < s.visibility_timeout_s
    assert s.inflight_window == 2 * s.max_num_seqs


@pytest.mark.parametrize(
    "overrides",
    [
        {"item_deadline_s": 100, "lease_s": 100},
        {"lease_s": 9000, "visibility_timeout_s": 8000},
        {"task_slice_s": 6000},
        {"heartbeat_s": 20, "worker_dead_after_s": 30},
        {"default_max_tokens": 10, "max_tokens_cap": 5},
    ],
)
def test_bad_timeouts_are_rejected(overrides: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        Settings(_env_file=None, **overrides)


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATABASE_URL", "postgresql://db/x")
    monkeypatch.setenv("MODEL", "Qwen/Qwen3-8B")
    monkeypatch.setenv("MAX_NUM_SEQS", "64")
    monkeypatch.setenv("SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 4}')
    s = Settings(_env_file=None)
    assert (s.database_url, s.model, s.max_num_seqs) == ("postgresql://db/x", "Qwen/Qwen3-8B", 64)
    assert s.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert s.model_name == "Qwen/Qwen3-8B"
