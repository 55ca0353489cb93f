"""The vLLM engine's LoRA arguments and adapter loading, without starting an engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from thinkbatch.settings import Settings
from worker.engine import AdapterError

# imports vLLM (and torch): ~15 s on this host
pytestmark = [pytest.mark.slow, pytest.mark.engine]

TWO = {"a": "/adapters/a", "b": "/adapters/b"}


def _settings(**values: Any) -> Settings:
    return Settings(_env_file=None, **values)


def test_no_adapters_no_lora() -> None:
    from worker.vllm_engine import lora_options

    assert lora_options(_settings(), "cpu") == {}


def test_the_slots_leave_one_empty_past_the_adapters_and_all_stay_loaded() -> None:
    from worker.vllm_engine import lora_options

    options = lora_options(_settings(lora_adapters=TWO, max_lora_rank=32), "cpu")
    assert options == {"enable_lora": True, "max_loras": 3, "max_lora_rank": 32,
                       "max_cpu_loras": 3}  # fmt: skip
    # On a GPU the kernels skip base rows: fewer slots than adapters is the operator's call,
    # and every adapter still stays loaded.
    gpu = lora_options(_settings(lora_adapters=TWO, max_loras=1), "cuda")
    assert (gpu["max_loras"], gpu["max_cpu_loras"]) == (1, 2)
    # On the CPU base rows read the last slot: it is kept empty whatever was asked.
    assert lora_options(_settings(lora_adapters=TWO, max_loras=1), "cpu")["max_loras"] == 3
    assert lora_options(_settings(lora_adapters=TWO, max_loras=5), "cpu")["max_loras"] == 5


def test_adapter_directories_are_checked_before_the_engine_starts(tmp_path: Path) -> None:
    from worker.vllm_engine import adapter_paths

    good = tmp_path / "good"
    good.mkdir()
    (good / "adapter_config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    got = adapter_paths({"good": str(good), "hub": "someone/some-adapter"})
    assert got == {"good": str(good.resolve()), "hub": "someone/some-adapter"}
    for path in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(AdapterError, match=r"'bad': .* is not an adapter directory"):
            adapter_paths({"bad": str(path)})


def _engine_with(add_lora: Any, held: list[int] | None = None) -> Any:
    from worker.vllm_engine import VLLMEngine

    async def list_loras() -> set[int]:
        return set(held or [])

    engine = VLLMEngine(_settings(lora_adapters=TWO))
    engine.llm = SimpleNamespace(add_lora=add_lora, list_loras=list_loras)  # type: ignore[assignment]
    return engine


def test_an_adapter_vllm_cannot_load_fails_the_start_with_its_name() -> None:
    async def add_lora(request: Any) -> bool:
        if request.lora_name == "b":
            # vLLM raises a plain Exception for a load that fails in its engine core.
            raise Exception("Call to add_lora method failed: No adapter found for /adapters/b")
        return True

    engine = _engine_with(add_lora, held=[1])
    with pytest.raises(AdapterError, match=r"'b' \(/adapters/b\) did not load: .*No adapter"):
        asyncio.run(engine._load_adapters(TWO))


def test_adapters_are_loaded_with_ids_from_one_and_all_held() -> None:
    seen: list[Any] = []

    async def add_lora(request: Any) -> bool:
        seen.append(request)
        return True

    engine = _engine_with(add_lora, held=[1, 2])
    asyncio.run(engine._load_adapters(TWO))
    assert [(r.lora_name, r.lora_int_id, r.lora_path) for r in seen] == [
        ("a", 1, "/adapters/a"),
        ("b", 2, "/adapters/b"),
    ]
    assert engine._adapters == {"a": seen[0], "b": seen[1]}

    short = _engine_with(add_lora, held=[2])
    with pytest.raises(AdapterError, match=r"holds 1 of 2 .*\['a'\].*max_cpu_loras"):
        asyncio.run(short._load_adapters(TWO))
