"""An item that overrides no params takes a short path through the submit's cross-layer check
(`Combinations._plain`); for any job of such items, mixed with items that override, and any
job params, it decides as the general path does with an empty override (`_NO_OVERRIDES`)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.helpers import make_settings
from thinkbatch.errors import InputError
from thinkbatch.jobs import combos
from thinkbatch.jobs.wire import ItemIn
from thinkbatch.jobs.wire import SamplingParamsIn

SETTINGS = make_settings("postgresql+psycopg://unused/unused", "redis://unused")
_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

# Item overrides and job params that meet in each of the cross-layer rules: tools with a raw
# prompt, n > 1 against temperature 0 either way round, and the logprob entries' product.
_PARAMS = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "n": st.integers(1, 4),
            "temperature": st.sampled_from([0, 0.7]),
            "max_tokens": st.integers(1, 4096),
            "logprobs": st.booleans(),
            "top_logprobs": st.integers(0, 20),
            "tools": st.just(_TOOLS),
        },
    ),
)


def _item(prompt: bool, params: dict[str, Any] | None) -> ItemIn:
    body: dict[str, Any] = (
        {"prompt": "p"} if prompt else {"messages": [{"role": "user", "content": "m"}]}
    )
    if params is not None:
        body["params"] = params
    return ItemIn.model_validate(body)


class _General(combos.Combinations):
    """The general path for every item, an empty override standing for none."""

    def item(self, index: int, item: ItemIn) -> None:
        if item.params is not None:
            super().item(index, item)
        else:
            self._overriding(index, item, combos._NO_OVERRIDES)


def _outcome(check: combos.Combinations, items: list[ItemIn], job: SamplingParamsIn) -> str:
    try:
        for index, item in enumerate(items):
            check.item(index, item)
        check.finish(job)
    except InputError as error:
        return f"{error.param}: {error}"
    return "accepted"


@hsettings(max_examples=300, deadline=None)
@given(
    items=st.lists(st.tuples(st.booleans(), _PARAMS), min_size=1, max_size=8),
    job=_PARAMS,
)
def test_a_plain_item_is_checked_as_an_empty_override(
    items: list[tuple[bool, dict[str, Any] | None]], job: dict[str, Any] | None
) -> None:
    try:
        built = [_item(prompt, params) for prompt, params in items]
        job_params = SamplingParamsIn.model_validate(job or {})
    except ValueError:
        return  # a shape the wire models refuse before any of this runs
    short, general = combos.Combinations(SETTINGS), _General(SETTINGS)
    assert _outcome(short, built, job_params) == _outcome(general, built, job_params)
    assert short._worst == general._worst
    assert short._prompt_inheriting_tools == general._prompt_inheriting_tools


def test_a_plain_prompt_item_meets_the_jobs_tools() -> None:
    """The rule the short path keeps state for: a raw prompt cannot inherit the job's tools."""
    check = combos.Combinations(SETTINGS)
    check.item(0, _item(False, None))
    check.item(1, _item(True, None))
    job = SamplingParamsIn.model_validate({"tools": _TOOLS})
    assert _outcome(check, [], job).startswith("items[1].prompt:")
