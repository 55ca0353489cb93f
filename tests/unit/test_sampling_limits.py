"""The API's sampling limits (thinkbatch/limits.py) against vLLM's own `SamplingParams`.

At every bound of the table, a value just inside and one just outside go through both the
API's schema and the engine's constructor. Where the bound is the engine's, the two must agree;
where it is ours (stricter), the API must refuse outside, and the engine must accept the value
inside unchanged. Whatever the API accepts, the engine takes as given: nothing is refused later
(a job that hangs) or silently altered.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from thinkbatch.jobs import SamplingParamsIn
from thinkbatch.limits import SAMPLING_LIMITS
from thinkbatch.limits import STOP_MAX_CHARS
from thinkbatch.limits import STOP_MAX_STRINGS
from thinkbatch.limits import Bound
from thinkbatch.limits import Limit


# The tests that ask vLLM's own SamplingParams are `slow`: importing vLLM (and torch) takes ~15 s
# on this host, so they import it when they run, and make check never loads it.
def engine_test(test: Any) -> Any:
    return pytest.mark.engine(pytest.mark.slow(test))


def _vllm() -> Any:
    return pytest.importorskip("vllm")


def _engine_accepts(name: str, value: object) -> bool:
    vllm = _vllm()
    VLLMValidationError = pytest.importorskip("vllm.exceptions").VLLMValidationError
    limit = SAMPLING_LIMITS.get(name)
    if limit is not None:
        name, value = limit.engine(value)  # the engine's own name and count of it
    try:
        params = vllm.SamplingParams(**{name: value})
    except VLLMValidationError:
        return False
    kept = getattr(params, name)
    if name == "stop":
        kept = kept[0] if isinstance(value, str) else kept
    assert kept == value, f"the engine changed {name}={value!r} to {kept!r}"
    return True


def _api_accepts(name: str, value: object) -> bool:
    try:
        SamplingParamsIn.model_validate({name: value})
    except ValidationError:
        return False
    return True


def _step(limit: Limit, value: float, direction: float) -> float:
    if limit.kind is int:
        return int(value) + int(direction)
    return math.nextafter(value, direction * math.inf)


def _boundary_values(limit: Limit, bound: Bound, side: str) -> tuple[float, float]:
    """(just inside, just outside) of a bound."""
    inward = 1 if side == "low" else -1
    at = int(bound.value) if limit.kind is int else float(bound.value)
    if bound.inclusive:
        return at, _step(limit, at, -inward)
    return _step(limit, at, inward), at


CASES = [
    (limit, bound, side)
    for limit in SAMPLING_LIMITS.values()
    for side, bound in (("low", limit.low), ("high", limit.high))
    if bound is not None
]


@engine_test
@pytest.mark.parametrize(
    ("limit", "bound", "side"), CASES, ids=[f"{c[0].name}-{c[2]}" for c in CASES]
)
def test_each_bound_against_the_engine(limit: Limit, bound: Bound, side: str) -> None:
    inside, outside = _boundary_values(limit, bound, side)
    assert _api_accepts(limit.name, inside), inside
    assert not _api_accepts(limit.name, outside), outside
    assert _engine_accepts(limit.name, inside), (limit.name, inside)
    if bound.source == "engine":
        assert not _engine_accepts(limit.name, outside), (limit.name, outside)
    else:
        assert bound.why, "a bound stricter than the engine's says why"


@engine_test
@pytest.mark.parametrize(
    "name", [n for n, limit in SAMPLING_LIMITS.items() if limit.min_nonzero is not None]
)
def test_values_the_engine_would_silently_raise_are_refused(name: str) -> None:
    floor = SAMPLING_LIMITS[name].min_nonzero
    assert floor is not None
    below = math.nextafter(floor, 0)
    assert _api_accepts(name, floor) and _engine_accepts(name, floor)
    assert not _api_accepts(name, below)
    assert _vllm().SamplingParams(**{name: below}).temperature == floor  # what it would do
    assert _api_accepts(name, 0.0) and _engine_accepts(name, 0.0)


def test_every_sampling_field_is_in_the_table_or_checked_here() -> None:
    numeric = {
        name
        for name, field in SamplingParamsIn.model_fields.items()
        if field.annotation in (int | None, float | None)
    }
    assert numeric == set(SAMPLING_LIMITS)


@pytest.mark.parametrize(
    "stop",
    ["", [""], ["a", ""], "x" * (STOP_MAX_CHARS + 1), ["s"] * (STOP_MAX_STRINGS + 1)],
)
def test_stop_strings_the_api_refuses(stop: object) -> None:
    assert not _api_accepts("stop", stop)


@engine_test
def test_empty_stop_strings_are_the_engines_rule() -> None:
    assert not _engine_accepts("stop", [""])
    assert not _engine_accepts("stop", "")


@engine_test
@pytest.mark.parametrize(
    "stop", ["END", ["a", "b"], "x" * STOP_MAX_CHARS, ["s"] * STOP_MAX_STRINGS]
)
def test_stop_strings_both_accept(stop: object) -> None:
    assert _api_accepts("stop", stop)
    assert _engine_accepts("stop", stop)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("name", [n for n, limit in SAMPLING_LIMITS.items() if limit.kind is float])
def test_non_finite_floats_are_refused(name: str, value: float) -> None:
    assert not _api_accepts(name, value)


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "4"])
def test_thinking_budgets_the_api_refuses(value: object) -> None:
    # -1 (our 0) is "unlimited" to the engine: a silently dropped budget, so it is refused.
    assert _api_accepts("thinking_budget", 1)
    assert not _api_accepts("thinking_budget", value)


@engine_test
def test_thinking_budget_counts_the_opening_tag_as_usage_does() -> None:
    # Ours counts <think> as usage.reasoning_tokens does; vLLM counts the tokens after it.
    assert SAMPLING_LIMITS["thinking_budget"].engine(16) == ("thinking_token_budget", 15)
    vllm = _vllm()
    assert vllm.SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    assert vllm.SamplingParams(thinking_token_budget=-1).thinking_token_budget is None


def test_no_accepted_repetition_penalty_overflows_the_engines_float32_logits() -> None:
    import numpy as np

    low = SAMPLING_LIMITS["repetition_penalty"].low
    assert low is not None and low.inclusive
    # vLLM divides a repeated token's positive logit by the penalty, in float32: at the
    # smallest accepted penalty, a logit at float32's largest over 1e4 stays finite.
    big = np.float32(np.finfo(np.float32).max / np.float32(1e4))
    assert np.isfinite(big / np.float32(low.value))
    for tiny in (1e-300, 1e-38, math.nextafter(low.value, 0)):
        assert not _api_accepts("repetition_penalty", tiny), tiny
