"""How the vLLM adapter classes a request's failure: through vLLM's own AsyncLLM.generate, which
re-raises its client errors and the engine's death as they are and wraps anything else in an
EngineGenerateError. A ValueError under that wrapper is the item's own fault (rejected, never
retried); any other wrapped error is the engine's (retried); a dead engine ends the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest

from thinkbatch.sampling import resolve_sampling
from thinkbatch.settings import Settings

# imports vLLM (and torch): ~15 s on this host
pytestmark = [pytest.mark.slow, pytest.mark.engine]


def _engine_failing_with(error: BaseException) -> Any:
    """A VLLMEngine whose requests go through vLLM's real AsyncLLM.generate, on an engine whose
    add_request (input processing and admission, where vLLM validates a request) raises."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from worker.vllm_engine import VLLMEngine

    async def add_request(*args: Any, **kwargs: Any) -> None:
        raise error

    async def abort(*args: Any, **kwargs: Any) -> None:
        return None

    core = SimpleNamespace(add_request=add_request, abort=abort, log_requests=False)

    def generate(prompt: Any, params: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        return AsyncLLM.generate(core, prompt, params, request_id, **kwargs)  # type: ignore[arg-type]

    engine = VLLMEngine(Settings(_env_file=None))
    engine.llm = SimpleNamespace(generate=generate)  # type: ignore[assignment]
    return engine


def _generate(engine: Any) -> Any:
    from vllm import SamplingParams

    from worker.engine import Prepared

    prepared = Prepared(
        prompt_ids=[1, 2, 3],
        opened_in_prompt=False,
        sampling=resolve_sampling({}, {}, default_max_tokens=8),
        native=SamplingParams(max_tokens=8),
    )
    return asyncio.run(engine.generate("7-1", prepared))


def test_a_value_error_in_the_request_path_rejects_the_item() -> None:
    from vllm.v1.engine.exceptions import EngineGenerateError

    from worker.engine import ItemRejected

    refusal = ValueError("sampling distribution replay requires temperature > 0")
    with pytest.raises(ItemRejected) as caught:
        _generate(_engine_failing_with(refusal))
    assert caught.value.code == "invalid_request"
    assert caught.value.message == str(refusal)
    # What vLLM raised, kept as the chain: its wrapper, and the refusal under it.
    assert isinstance(caught.value.__cause__, EngineGenerateError)
    assert caught.value.__cause__.__cause__ is refusal


def test_a_client_error_rejects_the_item() -> None:
    from vllm.exceptions import VLLMValidationError

    from worker.engine import ItemRejected

    with pytest.raises(ItemRejected) as caught:
        _generate(_engine_failing_with(VLLMValidationError("top_k must be -1", parameter="k")))
    assert caught.value.code == "invalid_request" and "top_k" in caught.value.message


def test_any_other_wrapped_error_stays_an_engine_error_to_retry() -> None:
    from vllm.v1.engine.exceptions import EngineGenerateError

    from worker.engine import ItemRejected

    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(EngineGenerateError) as caught:
        _generate(_engine_failing_with(fault))
    assert not isinstance(caught.value, ItemRejected)
    assert caught.value.__cause__ is fault


def test_a_dead_engine_is_the_workers_end() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from worker.engine import EngineDead

    with pytest.raises(EngineDead):
        _generate(_engine_failing_with(EngineDeadError()))
