"""How the vLLM adapter classes a request's failure: vLLM's own LLMEngine.add_request raises its
client errors and a plain ValueError for a request's values (the item is rejected, never
retried), EngineDeadError for a dead engine (the worker's end), and anything else is the
engine's fault (retried). Each request goes through the adapter's stepping thread as the worker
sends it."""

from __future__ import annotations

import asyncio
import functools
from types import SimpleNamespace
from typing import Any

import pytest

from thinkbatch.sampling import resolve_sampling

# imports vLLM (and torch): ~15 s on this host
pytestmark = [pytest.mark.slow, pytest.mark.engine]


def _engine_failing_with(error: BaseException) -> Any:
    """vLLM's real LLMEngine.add_request on an engine whose input processing (where vLLM
    validates a request) raises `error`, behind the adapter's stepping thread."""
    from vllm.v1.engine.llm_engine import LLMEngine

    from worker.stepper import Stepper
    from worker.vllm_engine import add_request
    from worker.vllm_engine import classify

    def process_inputs(*args: Any, **kwargs: Any) -> None:
        raise error

    core = SimpleNamespace(
        input_processor=SimpleNamespace(process_inputs=process_inputs),
        get_supported_tasks=lambda: ("generate",),
    )
    engine = SimpleNamespace(
        add_request=functools.partial(LLMEngine.add_request, core),
        has_unfinished_requests=lambda: False,
    )
    stepper = Stepper(engine, add=add_request, classify=classify)  # type: ignore[arg-type]
    stepper.start()
    return stepper


def _generate(engine: Any) -> Any:
    from vllm import SamplingParams

    from worker.engine import Prepared

    prepared = Prepared(
        prompt_ids=[1, 2, 3],
        opened_in_prompt=False,
        sampling=resolve_sampling({}, {}, default_max_tokens=8),
        native=SamplingParams(max_tokens=8),
    )
    try:
        return asyncio.run(engine.run("7-1", prepared))
    finally:
        engine.stop()


def test_a_value_error_in_the_request_path_rejects_the_item() -> None:
    from worker.engine import ItemRejected

    refusal = ValueError("sampling distribution replay requires temperature > 0")
    with pytest.raises(ItemRejected) as caught:
        _generate(_engine_failing_with(refusal))
    assert caught.value.code == "invalid_request"
    assert caught.value.message == str(refusal)


def test_a_client_error_rejects_the_item() -> None:
    from vllm.exceptions import VLLMValidationError

    from worker.engine import ItemRejected

    with pytest.raises(ItemRejected) as caught:
        _generate(_engine_failing_with(VLLMValidationError("top_k must be -1", parameter="k")))
    assert caught.value.code == "invalid_request" and "top_k" in caught.value.message


def test_any_other_error_stays_an_engine_error_to_retry() -> None:
    from worker.engine import ItemRejected

    fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError) as caught:
        _generate(_engine_failing_with(fault))
    assert not isinstance(caught.value, ItemRejected)
    assert caught.value is fault


def test_a_dead_engine_is_the_workers_end() -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    from worker.engine import EngineDead

    with pytest.raises(EngineDead):
        _generate(_engine_failing_with(EngineDeadError()))
