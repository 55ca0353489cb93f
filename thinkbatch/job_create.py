"""Creating jobs: the checks on a submission, each item's COPY row, and the job row around
them, all in the caller's transaction. The REST API's submit (a streamed body) and the OpenAI
batches (an uploaded JSONL file, thinkbatch/batches.py) build jobs from these same parts; any
invalid item rolls the whole job back.
"""

from __future__ import annotations

import json
import math
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import IO

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy import orm

from thinkbatch import context
from thinkbatch import ingest
from thinkbatch import quotas
from thinkbatch.budgets import BudgetCheck
from thinkbatch.budgets import BudgetConflict
from thinkbatch.context import ContextBound
from thinkbatch.jobs import InvalidRequest
from thinkbatch.keys import Caller
from thinkbatch.limits import range_text
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.schemas import ItemIn
from thinkbatch.schemas import JobCreate
from thinkbatch.schemas import JobHeader
from thinkbatch.schemas import Message
from thinkbatch.settings import Settings


def _check_max_tokens(value: int | None, param: str, settings: Settings) -> None:
    if value is not None and value > settings.max_tokens_cap:
        raise InvalidRequest(
            f"{param}: {value} is above the cap of {settings.max_tokens_cap}",
            param=param,
            code="max_tokens_too_large",
        )


def _check_header(header: JobHeader, settings: Settings) -> None:
    if header.model is not None and header.model != settings.model_name:
        raise InvalidRequest(
            f"model: unknown model {header.model!r}; this deployment serves "
            f"{settings.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if header.completion_window is not None and (
        header.completion_window > settings.max_completion_window_s
    ):
        raise InvalidRequest(
            f"completion_window: at most {settings.max_completion_window_s} seconds",
            param="completion_window",
        )
    _check_max_tokens(header.params.max_tokens, "params.max_tokens", settings)


class ItemRows:
    """Checks that span items (custom_id uniqueness, the item limit) and their COPY rows."""

    def __init__(self, job_id: uuid.UUID, settings: Settings, context: ContextBound | None = None):
        self.job_id = job_id
        self.settings = settings
        self.context = context  # None: no live worker told the model's bound
        self.ids: dict[str, int] = {}  # custom_id -> index; generated ones are negative
        self.count = 0
        self.budgets = BudgetCheck(settings.default_max_tokens)

    def row(self, index: int, item: ItemIn) -> tuple[object, ...]:
        if index >= self.settings.max_items_per_job:
            raise InvalidRequest(
                f"items: more than the limit of {self.settings.max_items_per_job} items",
                param="items",
                code="too_many_items",
            )
        if item.params is not None:
            _check_max_tokens(
                item.params.max_tokens, f"items[{index}].params.max_tokens", self.settings
            )
        try:
            self.budgets.item(index, item.params)
        except BudgetConflict as error:
            raise InvalidRequest(error.message, param=error.param) from None
        custom_id = item.custom_id
        if custom_id is None:
            custom_id = f"item-{index}"
            while custom_id in self.ids:  # never collide with an id the user chose
                custom_id += "_"
            self.ids[custom_id] = -1 - index
        else:
            first = self.ids.setdefault(custom_id, index)
            if first != index:
                param = f"items[{index}].custom_id"
                if first < 0:
                    raise InvalidRequest(
                        f"{param}: {custom_id!r} is the id generated for items[{-1 - first}], "
                        f"which has no custom_id; give it one",
                        param=param,
                        code="duplicate_custom_id",
                    )
                raise InvalidRequest(
                    f"{param}: duplicate custom_id {custom_id!r} (first used by items[{first}])",
                    param=param,
                    code="duplicate_custom_id",
                )
        self._check_size(index, item)
        self.count += 1
        # Serialized by pydantic's Rust core: json.dumps over model_dump() cost 4x as much.
        messages = (
            _MESSAGES.dump_json(item.messages).decode() if item.messages is not None else None
        )
        params = item.params.overrides() if item.params is not None else None
        return (
            self.job_id,
            index,
            custom_id,
            messages,
            item.prompt,
            json.dumps(params) if params else None,
            ItemStatus.pending.value,
        )

    def finish(self, header: JobHeader) -> None:
        """The checks that need the job's params and every item (streamed in any order)."""
        try:
            self.budgets.finish(header.params)
        except BudgetConflict as error:
            raise InvalidRequest(error.message, param=error.param) from None

    def _check_size(self, index: int, item: ItemIn) -> None:
        # Bounded here, at submit: a 5 MB prompt would cost the worker seconds of tokenizing
        # before it could fail as too long for the model.
        cap = self.settings.max_prompt_chars
        if item.prompt is not None:
            size, param = len(item.prompt), f"items[{index}].prompt"
        else:
            size = sum(len(m.content) for m in item.messages or ())
            param = f"items[{index}].messages"
        if size > cap:
            what = "characters" if item.prompt is not None else "characters of content in all"
            raise InvalidRequest(
                f"{param}: {size} {what} is more than the limit of {cap} (MAX_PROMPT_CHARS)",
                param=param,
                code="prompt_too_large",
            )
        if self.context is not None and (why := self.context.refusal(item)) is not None:
            raise InvalidRequest(f"{param}: {why}", param=param, code="prompt_too_long")


_MESSAGES = TypeAdapter(list[Message])
_COPY_ITEMS = "COPY items (job_id, seq, custom_id, messages, prompt, params, status) FROM STDIN"


def copy_items(session: orm.Session, rows: Iterator[tuple[object, ...]]) -> None:
    driver = session.connection().connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor, cursor.copy(_COPY_ITEMS) as copy:
        for row in rows:
            copy.write_row(row)


def model_context(session: orm.Session, settings: Settings) -> ContextBound | None:
    """The served model's context bound, from its live workers (thinkbatch/context.py)."""
    return context.for_model(
        session, settings.model_name, dead_after_s=settings.worker_dead_after_s
    )


def new_job(session: orm.Session, caller: Caller, settings: Settings) -> Job:
    # The tenant's submissions are serialized from here to the commit, so that its quotas
    # hold under parallel submits; the cheap checks come before any item is read.
    quotas.lock_tenant(session, caller.tenant)
    quotas.check_submission_rate(session, caller.tenant, settings)
    quotas.check_unfinished_items(session, caller.tenant, 1, settings)
    now = datetime.now(UTC)
    job = Job(
        id=uuid.uuid4(),
        tenant=caller.tenant,
        status=JobStatus.queued,
        model=settings.model_name,
        params={},
        meta={},
        created_at=now,
        expires_at=now + timedelta(seconds=settings.default_completion_window_s),
    )
    session.add(job)
    session.flush()
    return job


def apply_header(session: orm.Session, job: Job, header: JobHeader, settings: Settings) -> None:
    quotas.check_unfinished_items(
        session, job.tenant, job_items(session, job), settings, exclude=job.id
    )
    job.params = header.params.overrides()
    job.meta = dict(header.metadata)
    job.priority = header.priority
    window = header.completion_window or settings.default_completion_window_s
    job.expires_at = job.created_at + timedelta(seconds=window)
    session.flush()
    session.refresh(job)  # counters come from the insert trigger


def job_items(session: orm.Session, job: Job) -> int:
    """Items stored for a job so far in this transaction (its count, kept by the trigger)."""
    return int(session.scalar(sa.select(Job.total).where(Job.id == job.id)) or 0)


def create_job(session: orm.Session, caller: Caller, spec: JobCreate, settings: Settings) -> Job:
    """Store a job given as a validated `JobCreate`, in the session's transaction.

    The API and the tests store jobs through `create_job_from_stream` (the request body as it
    streams); this stays for the throughput benchmark, which builds a spec of thousands of
    items in memory and would only re-serialize it to feed the stream parser."""
    _check_header(spec, settings)
    job = new_job(session, caller, settings)
    items = ItemRows(job.id, settings, model_context(session, settings))
    copy_items(session, (items.row(i, item) for i, item in enumerate(spec.items)))
    items.finish(spec)
    apply_header(session, job, spec, settings)
    return job


def create_job_from_stream(
    session: orm.Session, caller: Caller, body: IO[bytes], settings: Settings
) -> Job:
    """Store a job read from a JSON request body, validating as it streams (see ingest)."""
    try:
        job = new_job(session, caller, settings)
        items = ItemRows(job.id, settings, model_context(session, settings))
        fields: dict[str, object] = {}
        saw_items = False

        def rows() -> Iterator[tuple[object, ...]]:
            nonlocal saw_items
            for kind, value in ingest.read_body(body, ingest.Limits.of(settings)):
                if kind == "field":
                    key, raw = value
                    fields[key] = raw
                elif kind == "items":
                    saw_items = True
                else:
                    yield items.row(items.count, ingest.parse_item(items.count, value))

        copy_items(session, rows())
        if not saw_items:
            ingest.parse_header(fields)  # a bad header field is the better message
            raise InvalidRequest("items: Field required", param="items", code="missing")
        if items.count == 0:
            raise InvalidRequest(
                "items: List should have at least 1 item after validation, not 0",
                param="items",
                code="too_short",
            )
        header = ingest.parse_header(fields)
    except ingest.BodyError as error:
        message = _body_message(error, settings)
        raise InvalidRequest(message, param=error.param, code=error.code) from None
    _check_header(header, settings)
    items.finish(header)
    apply_header(session, job, header, settings)
    return job


def _body_message(error: ingest.BodyError, settings: Settings) -> str:
    """A number too large for the parser: say which values the field takes."""
    if not error.code.endswith("_out_of_range") or error.param is None:
        return error.message
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
    return f"{error.message}; it must be {allowed}"


def _header_range(name: str) -> str:
    bounds = {
        type(m).__name__: getattr(m, type(m).__name__.lower())
        for m in JobHeader.model_fields[name].metadata
    }
    return f"an integer from {bounds['Ge']} to {bounds['Le']}"


def fanout(job: Job, settings: Settings) -> int:
    """Task messages for a new job: one per FANOUT_ITEMS items, up to JOB_FANOUT, so that idle
    workers join a big job while a small one costs one message. A worker that already drives
    the job drops an extra message at once."""
    return max(1, min(settings.job_fanout, math.ceil(job.total / settings.fanout_items)))
