"""Settings: read from the environment in one place; timeouts must nest."""

from __future__ import annotations

from pathlib import Path

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


def test_the_window_may_not_grow_to_less_than_its_size_at_rest() -> None:
    with pytest.raises(ValidationError, match="INFLIGHT_MAX_FACTOR must be at least"):
        Settings(_env_file=None, inflight_factor=4, inflight_max_factor=3)
    s = Settings(_env_file=None, max_num_seqs=100, inflight_factor=2, inflight_max_factor=8)
    assert (s.inflight_window, s.inflight_window_most) == (200, 800)


@pytest.mark.parametrize(
    ("names", "adapters", "match"),
    [
        ({"model": "Qwen/Qwen3-8B"}, {"Qwen/Qwen3-8B": "/a"}, "base model's served name"),
        ({"served_model_name": "qwen"}, {"qwen": "/a"}, "base model's served name"),
        ({}, {"": "/a"}, "not a served name"),
        ({}, {" sql": "/a"}, "not a served name"),
    ],
)
def test_an_adapter_must_have_a_name_of_its_own(
    names: dict[str, str], adapters: dict[str, str], match: str
) -> None:
    # An adapter under the base model's name would take every item of the base model.
    with pytest.raises(ValidationError, match=match):
        Settings(_env_file=None, lora_adapters=adapters, **names)
    assert Settings(_env_file=None, lora_adapters={"sql": "/a"}, **names).served_names[1:] == [
        "sql"
    ]


def test_environment_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THINKBATCH_DATABASE_URL", "postgresql://db/x")
    monkeypatch.setenv("THINKBATCH_MODEL", "Qwen/Qwen3-8B")
    monkeypatch.setenv("thinkbatch_max_num_seqs", "64")  # case-insensitive
    monkeypatch.setenv(
        "THINKBATCH_SPECULATIVE_CONFIG", '{"method": "ngram", "num_speculative_tokens": 4}'
    )
    s = Settings(_env_file=None)
    assert (s.require_database_url(), s.model, s.max_num_seqs) == (
        "postgresql://db/x",
        "Qwen/Qwen3-8B",
        64,
    )
    assert s.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    assert s.model_name == "Qwen/Qwen3-8B"


def test_old_names_still_work_and_warn_once_naming_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL", "Qwen/Qwen3-0.6B")
    monkeypatch.setenv("SEED", "7")
    monkeypatch.setenv("SPECULATIVE_CONFIG", '{"method": "ngram"}')
    with pytest.warns(FutureWarning) as caught:
        s = Settings(_env_file=None)
    assert (s.model, s.seed, s.speculative_config) == ("Qwen/Qwen3-0.6B", 7, {"method": "ngram"})
    assert len(caught) == 1
    message = str(caught[0].message)
    for old in ("MODEL", "SEED", "SPECULATIVE_CONFIG"):
        assert f"{old} -> THINKBATCH_{old}" in message


def test_the_prefixed_name_wins_over_the_old_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENGINE", "fake")
    monkeypatch.setenv("THINKBATCH_ENGINE", "vllm")
    monkeypatch.setenv("THINKBATCH_DTYPE", "float32")
    with pytest.warns(FutureWarning, match="ENGINE -> THINKBATCH_ENGINE"):
        s = Settings(_env_file=None)
    assert (s.engine, s.dtype) == ("vllm", "float32")


def test_new_names_alone_do_not_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    # pytest runs with filterwarnings = error: any warning here fails the test.
    monkeypatch.setenv("THINKBATCH_SEED", "3")
    assert Settings(_env_file=None).seed == 3


def test_old_names_in_the_env_file_warn_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env_file = tmp_path / ".env"
    env_file.write_text("DTYPE=bfloat16\nTHINKBATCH_SEED=5\nMAX_NUM_SEQS=12\n")
    with pytest.warns(FutureWarning) as caught:
        s = Settings(_env_file=env_file)
    assert (s.dtype, s.seed, s.max_num_seqs) == ("bfloat16", 5, 12)
    (warning,) = caught
    assert "DTYPE -> THINKBATCH_DTYPE" in str(warning.message)
    assert "MAX_NUM_SEQS -> THINKBATCH_MAX_NUM_SEQS" in str(warning.message)
    assert "SEED ->" not in str(warning.message)
    # The environment's old name is read over the file's, as the new names are.
    monkeypatch.setenv("DTYPE", "float16")
    with pytest.warns(FutureWarning):
        assert Settings(_env_file=env_file).dtype == "float16"


def test_prometheus_own_variable_is_no_deprecated_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # gunicorn.conf.py sets it for prometheus-client in every API process.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/srv/metrics")
    assert Settings(_env_file=None).prometheus_multiproc_dir == Path("/srv/metrics")


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("THINKBATCH_DATABASE_URL", "mysql://u:secret@db/x"),
        ("THINKBATCH_DATABASE_URL", "not a url"),
        ("THINKBATCH_REDIS_URL", "http://u:secret@redis:6379/0"),
    ],
)
def test_a_bad_url_fails_at_start_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as error:
        Settings(_env_file=None)
    assert f"{variable} is not a valid URL" in str(error.value)
    assert "secret" not in str(error.value)  # a URL's password is never echoed


def test_urls_leave_as_the_strings_given() -> None:
    s = Settings(
        _env_file=None,
        database_url="postgresql+psycopg://postgres@127.0.0.1:5432/tb",
        redis_url="redis://:pw@127.0.0.1:6379/12",
    )
    assert s.require_database_url() == "postgresql+psycopg://postgres@127.0.0.1:5432/tb"
    assert s.require_redis_url() == "redis://:pw@127.0.0.1:6379/12"


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg:///thinkbatch?host=/run/postgresql",  # a Unix socket, no host
        "postgresql+psycopg://u@db1:5432,db2:5432/thinkbatch",  # libpq's several hosts
        "postgresql+psycopg://u:p%40ss@db/thinkbatch",  # a percent-encoded password
    ],
)
def test_postgres_urls_libpq_takes_are_accepted_unchanged(url: str) -> None:
    assert Settings(_env_file=None, database_url=url).require_database_url() == url
