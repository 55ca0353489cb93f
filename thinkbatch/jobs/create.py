"""The checks on a submission: its header, each item and what spans items (custom_id
uniqueness, the item limit, thinking budgets, the model's context), and each item's COPY row.
The front door (service.py) runs them inside the transaction that stores the job, so any
invalid item stores nothing, unless its caller turns the item into a `RefusedItem`: a line of
an OpenAI batch whose request body is at fault is stored as a failed item, as OpenAI answers
such a line in the error file while the rest of the batch runs.
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import TypeAdapter
from pydantic import ValidationError

from thinkbatch.errors import InputError
from thinkbatch.guard import validation_error
from thinkbatch.jobs.budgets import BudgetCheck
from thinkbatch.jobs.combos import Combinations
from thinkbatch.jobs.combos import check_params
from thinkbatch.jobs.context import ContextBound
from thinkbatch.jobs.fleet import Fleet
from thinkbatch.jobs.prefix import prefix_key
from thinkbatch.jobs.wire import ItemIn
from thinkbatch.jobs.wire import JobHeader
from thinkbatch.jobs.wire import Message
from thinkbatch.jobs.wire import SamplingParamsIn
from thinkbatch.limits import range_text
from thinkbatch.models import ItemStatus
from thinkbatch.settings import Settings


def _check_max_tokens(value: int | None, param: str, settings: Settings) -> None:
    if value is not None and value > settings.max_tokens_cap:
        raise InputError(
            f"{param}: {value} is above the cap of {settings.max_tokens_cap}",
            param=param,
            code="max_tokens_too_large",
        )


def check_header(header: JobHeader, settings: Settings, fleet: Fleet | None = None) -> None:
    if header.model is not None:
        (fleet or Fleet(settings.configured_models)).check(header.model, "model")
    if header.completion_window is not None and (
        header.completion_window > settings.max_completion_window_s
    ):
        raise InputError(
            f"completion_window: at most {settings.max_completion_window_s} seconds",
            param="completion_window",
        )
    _check_max_tokens(header.params.max_tokens, "params.max_tokens", settings)
    check_params(header.params, "params", settings)


def parse_item(index: int, raw: Any) -> ItemIn:
    try:
        return ItemIn.model_validate(raw)
    except ValidationError as error:
        raise validation_error(error, f"items[{index}]", raw) from None


def parse_header(fields: dict[str, Any]) -> JobHeader:
    try:
        return JobHeader.model_validate(fields)
    except ValidationError as error:
        raise validation_error(error, data=fields) from None


@dataclass(frozen=True, slots=True)
class RefusedItem:
    """An item whose request could not be accepted, stored `failed` with no input: it keeps
    its place (seq) and its custom_id, which stays unique in the job, and never runs. `param`
    names the field at fault in the caller's own terms."""

    custom_id: str
    code: str
    message: str
    param: str | None = None
    model: str | None = None  # what the request named, shown in its record; it never runs


class ItemRows:
    """Checks that span items (custom_id uniqueness, the item limit) and their COPY rows.

    `job_params`: the job's params, when they are known before its items (not in a streamed
    body, which may give them last). Each item is then checked against them as it comes, so
    that an item's error is raised by its own row (and can be refused alone), never later by
    `finish` for whichever item was closest to a limit."""

    def __init__(
        self,
        job_id: uuid.UUID,
        settings: Settings,
        context: ContextBound | None = None,
        job_params: SamplingParamsIn | None = None,
        fleet: Fleet | None = None,
        bounds: dict[str, ContextBound | None] | None = None,
        default_model: str | None = None,
        *,
        stored_at: datetime,
    ):
        self.job_id = job_id
        # When a refused item finished: its job's creation, on the database's clock.
        self.stored_at = stored_at
        self.settings = settings
        self.context = context  # None: no live worker told the model's bound
        # A streamed body may name the job's model after its items: until it is known
        # (`use_model`), an item that names none is checked against every model's bound and
        # the first refusal for each is kept, for `finish` to raise for the job's model. None:
        # the job's model was known from the start (`context` is its bound).
        self._default_model = default_model
        self._refusals: dict[str, InputError] | None = {} if default_model is not None else None
        self.job_params = job_params
        self.fleet = fleet or Fleet(settings.configured_models)
        # The context bound of each model an item may name (read before the items stream).
        self._bounds = bounds or {}
        # Items by the model they name; those that name none run on the job's.
        self.by_model: dict[str, int] = {}
        self.job_model_items = 0
        self.ids: dict[str, int] = {}  # custom_id -> index; generated ones are negative
        self.count = 0
        self.refused_count = 0
        self.budgets = BudgetCheck(settings.default_max_tokens)
        self.combos = Combinations(settings)
        # Without a key, items are claimed in the order they came (CLAIM_ORDER).
        self.by_prefix = settings.claim_order == "prefix"

    def row(self, index: int, item: ItemIn) -> tuple[object, ...]:
        self._check_limit(index)
        if item.params is not None:
            _check_max_tokens(
                item.params.max_tokens, f"items[{index}].params.max_tokens", self.settings
            )
        if self.job_params is None:
            self.budgets.item(index, item.params)
            self.combos.item(index, item)
        else:
            budgets = BudgetCheck(self.settings.default_max_tokens)
            budgets.item(index, item.params)
            budgets.finish(self.job_params)
            combos = Combinations(self.settings)
            combos.item(index, item)
            combos.finish(self.job_params)
        custom_id = item.custom_id
        if custom_id is None:
            custom_id = f"item-{index}"
            while custom_id in self.ids:  # never collide with an id the user chose
                custom_id += "_"
            self.ids[custom_id] = -1 - index
        else:
            self._claim_id(index, custom_id)
        model = item.model
        if model is not None:
            if model not in self.by_model:
                self.fleet.check(model, f"items[{index}].model")
            self.by_model[model] = self.by_model.get(model, 0) + 1
        else:
            self.job_model_items += 1
        self._check_size(index, item)
        self.count += 1
        # Serialized by pydantic's Rust core: json.dumps over model_dump() cost 4x as much.
        messages = (
            _MESSAGES.dump_json(item.messages, exclude_none=True)
            if item.messages is not None
            else None
        )
        params = item.params.overrides() if item.params is not None else None
        key = None
        if self.by_prefix:
            tools = params.get("tools") if params else None
            key = prefix_key(
                model,
                json.dumps(tools).encode() if tools else None,
                messages if messages is not None else (item.prompt or "").encode(),
            )
        return (
            self.job_id,
            index,
            custom_id,
            messages.decode() if messages is not None else None,
            item.prompt,
            json.dumps(params) if params else None,
            ItemStatus.pending.value,
            None,
            None,
            None,
            None,
            model,
            key,
        )

    def refused(self, index: int, item: RefusedItem) -> tuple[object, ...]:
        """The failed row of a refused item. Its place and its custom_id are still checked:
        those are faults of the submission as a whole."""
        self._check_limit(index)
        self._claim_id(index, item.custom_id)
        self.count += 1
        self.refused_count += 1
        return (
            self.job_id,
            index,
            item.custom_id,
            None,
            None,
            None,
            ItemStatus.failed.value,
            item.code,
            item.message,
            item.param,
            self.stored_at,
            item.model,
            None,
        )

    def _check_limit(self, index: int) -> None:
        if index >= self.settings.max_items_per_job:
            raise InputError(
                f"items: more than the limit of {self.settings.max_items_per_job} items",
                param="items",
                code="too_many_items",
            )

    def _claim_id(self, index: int, custom_id: str) -> None:
        first = self.ids.setdefault(custom_id, index)
        if first == index:
            return
        param = f"items[{index}].custom_id"
        if first < 0:
            raise InputError(
                f"{param}: {custom_id!r} is the id generated for items[{-1 - first}], "
                f"which has no custom_id; give it one",
                param=param,
                code="duplicate_custom_id",
            )
        raise InputError(
            f"{param}: duplicate custom_id {custom_id!r} (first used by items[{first}])",
            param=param,
            code="duplicate_custom_id",
        )

    def use_model(self, name: str) -> None:
        """The job's model, known before its items come: each is checked against its bound."""
        self.context = self._bounds.get(name)
        self._refusals = None

    def finish(self, header: JobHeader) -> None:
        """The checks that need the job's params and every item (streamed in any order)."""
        self.budgets.finish(header.params)
        self.combos.finish(header.params)
        if self._refusals is not None:
            refused = self._refusals.get(header.model or self._default_model or "")
            if refused is not None:
                raise refused
        # Items that name no model, in a job that names none, run on the deployment's MODEL:
        # refused as a named model is when the fleet neither is configured for it nor has a
        # live worker of it; no worker would ever claim them.
        if header.model is None and self.job_model_items:
            default = self.settings.model_name
            self.fleet.check(
                default,
                "model",
                f"the job names no model, and the deployment's default {default!r} (MODEL) "
                "is not one it serves",
            )

    def _check_size(self, index: int, item: ItemIn) -> None:
        # Bounded here, at submit: a 5 MB prompt would cost the worker seconds of tokenizing
        # before it could fail as too long for the model.
        cap = self.settings.max_prompt_chars
        if item.prompt is not None:
            size, param = len(item.prompt), f"items[{index}].prompt"
        else:
            size = sum(len(m.content or "") for m in item.messages or ())
            param = f"items[{index}].messages"
        if size > cap:
            what = "characters" if item.prompt is not None else "characters of content in all"
            raise InputError(
                f"{param}: {size} {what} is more than the limit of {cap} (MAX_PROMPT_CHARS)",
                param=param,
                code="prompt_too_large",
            )
        if item.model is None and self._refusals is not None:
            for name, bound in self._bounds.items():
                if bound is not None and name not in self._refusals:
                    if (why := bound.refusal(item)) is not None:
                        self._refusals[name] = _too_long(param, why)
            return
        context = self._context(item.model)
        if context is not None and (why := context.refusal(item)) is not None:
            raise _too_long(param, why)

    def _context(self, model: str | None) -> ContextBound | None:
        if model is None:
            return self.context
        return self._bounds.get(model)

    def models(self, job_model: str) -> list[str]:
        """The job's distinct models, once every item is in."""
        names = set(self.by_model)
        if self.job_model_items:
            names.add(job_model)
        return sorted(names)

    def job_model(self, header: JobHeader) -> str:
        """The job's model: its header's; else, when every item names one, the model most of
        them name; else the deployment's (MODEL), which `finish` checks is served."""
        if header.model is not None:
            return header.model
        if not self.job_model_items and self.by_model:
            # No item runs on a default: the name most of them run on (the first such name in
            # order on a tie), never a model none of them names.
            return min(self.by_model, key=lambda name: (-self.by_model[name], name))
        return self.settings.model_name


_MESSAGES = TypeAdapter(list[Message])


def out_of_range(error: InputError, settings: Settings) -> InputError:
    """A number too large for the parser: the same error, saying which values the field takes."""
    if not error.code.endswith("_out_of_range") or error.param is None:
        return error
    name = error.param.rsplit(".", 1)[-1]
    allowed = {
        "max_tokens": f"an integer from 1 to {settings.max_tokens_cap} (MAX_TOKENS_CAP)",
        "priority": _header_range("priority"),
        "completion_window": f"an integer from 1 to {settings.max_completion_window_s}",
    }.get(name)
    if allowed is None and (text := range_text(name)) is not None:
        allowed = text
    if allowed is None:
        allowed = f"within -2^63 to 2^63-1 (integers) or {sys.float_info.max:.3g} (numbers)"
    return InputError(f"{error.message}; it must be {allowed}", param=error.param, code=error.code)


def _header_range(name: str) -> str:
    bounds = {
        type(m).__name__: getattr(m, type(m).__name__.lower())
        for m in JobHeader.model_fields[name].metadata
    }
    return f"an integer from {bounds['Ge']} to {bounds['Le']}"


def fanout(items: int, settings: Settings) -> int:
    """Task messages for a new job: one per FANOUT_ITEMS items, up to JOB_FANOUT, so that idle
    workers join a big job while a small one costs one message. A worker that already drives
    the job drops an extra message at once."""
    return max(1, min(settings.job_fanout, math.ceil(items / settings.fanout_items)))


def _too_long(param: str, why: str) -> InputError:
    return InputError(f"{param}: {why}", param=param, code="prompt_too_long")
