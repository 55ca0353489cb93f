"""The rule `thinking_budget < max_tokens`, for every item of a job, checked at submit.

Each of thinking_budget, max_tokens and enable_thinking may come from the item, from the job or
from the defaults, and a streamed body may give the job's own params after its items. So the
check keeps, for each pattern of what an item overrides, only the item closest to breaking the
rule (the smallest max_tokens, the largest budget), in constant memory however many items, and
decides once the job's params are known. With thinking off the budget is ignored, not refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from thinkbatch.errors import InputError
from thinkbatch.jobs.wire import SamplingParamsIn

# What an item overrides: (max_tokens, thinking_budget, enable_thinking True or unset).
_Pattern = tuple[bool, bool, bool | None]


@dataclass(slots=True)
class _Worst:
    index: int
    max_tokens: int | None
    budget: int | None


class BudgetCheck:
    def __init__(self, default_max_tokens: int):
        self.default_max_tokens = default_max_tokens
        self._worst: dict[_Pattern, _Worst] = {}

    def item(self, index: int, params: SamplingParamsIn | None) -> None:
        max_tokens = params.max_tokens if params is not None else None
        budget = params.thinking_budget if params is not None else None
        thinking = params.enable_thinking if params is not None else None
        if thinking is False:
            return  # the budget is ignored with thinking off
        if params is not None and params.reasoning_effort is not None:
            return  # the effort decides: its budget applies only below max_tokens
        pattern = (max_tokens is not None, budget is not None, thinking)
        if max_tokens is not None and budget is not None:
            if budget < max_tokens:
                return  # holds whatever the job says
            if thinking is True:
                _raise(index, max_tokens, budget, pattern)
        worst = self._worst.get(pattern)
        if (
            worst is None
            or (max_tokens is not None and budget is None and max_tokens < (worst.max_tokens or 0))
            or (budget is not None and max_tokens is None and budget > (worst.budget or 0))
        ):
            self._worst[pattern] = _Worst(index, max_tokens, budget)

    def finish(self, job: SamplingParamsIn) -> None:
        """Check every kept item against the job's params (raises InputError)."""
        job_thinking = job.enable_thinking is not False and job.reasoning_effort != "none"
        for pattern, worst in sorted(self._worst.items(), key=lambda kv: kv[1].index):
            thinking = pattern[2] if pattern[2] is not None else job_thinking
            if not thinking:
                continue
            max_tokens = worst.max_tokens or job.max_tokens or self.default_max_tokens
            budget = worst.budget if worst.budget is not None else job.thinking_budget
            if budget is not None and budget >= max_tokens:
                _raise(worst.index, max_tokens, budget, pattern, job)


def _raise(
    index: int,
    max_tokens: int,
    budget: int,
    pattern: _Pattern,
    job: SamplingParamsIn | None = None,
) -> None:
    item_sets_max, item_sets_budget, _ = pattern
    param = "params.thinking_budget"
    if item_sets_budget:
        param = f"items[{index}].params.thinking_budget"
    if item_sets_max:
        source = f"items[{index}].params.max_tokens"
    elif job is not None and job.max_tokens is not None:
        source = "params.max_tokens"
    else:
        source = "DEFAULT_MAX_TOKENS"
    raise InputError(
        f"{param}: {budget} must be below max_tokens, which is {max_tokens} for items[{index}] "
        f"({source}): the model needs tokens left to answer",
        param=param,
    )
