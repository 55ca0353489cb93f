"""Jobs as a service: create, read, page, stream, cancel. The REST API is a thin layer over this,
and so will be the OpenAI Batch facade and the CLI.
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
from typing import Any

import sqlalchemy as sa
from pydantic import TypeAdapter
from sqlalchemy import orm

from thinkbatch import ingest
from thinkbatch import ledger
from thinkbatch import quotas
from thinkbatch import stats
from thinkbatch.budgets import BudgetCheck
from thinkbatch.budgets import BudgetConflict
from thinkbatch.keys import Caller
from thinkbatch.limits import range_text
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.schemas import Counts
from thinkbatch.schemas import ErrorInfo
from thinkbatch.schemas import ItemIn
from thinkbatch.schemas import ItemOut
from thinkbatch.schemas import ItemPage
from thinkbatch.schemas import JobCreate
from thinkbatch.schemas import JobHeader
from thinkbatch.schemas import JobOut
from thinkbatch.schemas import JobPage
from thinkbatch.schemas import JobStats
from thinkbatch.schemas import Message
from thinkbatch.schemas import Usage
from thinkbatch.settings import Settings


class InvalidRequest(Exception):
    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass


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


class _Items:
    """Checks that span items (custom_id uniqueness, the item limit) and their COPY rows."""

    def __init__(self, job_id: uuid.UUID, settings: Settings):
        self.job_id = job_id
        self.settings = settings
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


_MESSAGES = TypeAdapter(list[Message])
_COPY_ITEMS = "COPY items (job_id, seq, custom_id, messages, prompt, params, status) FROM STDIN"


def _copy(session: orm.Session, rows: Iterator[tuple[object, ...]]) -> None:
    driver = session.connection().connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor, cursor.copy(_COPY_ITEMS) as copy:
        for row in rows:
            copy.write_row(row)


def _new_job(session: orm.Session, caller: Caller, settings: Settings) -> Job:
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


def _apply_header(session: orm.Session, job: Job, header: JobHeader, settings: Settings) -> None:
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
    job = _new_job(session, caller, settings)
    items = _Items(job.id, settings)
    _copy(session, (items.row(i, item) for i, item in enumerate(spec.items)))
    items.finish(spec)
    _apply_header(session, job, spec, settings)
    return job


def create_job_from_stream(
    session: orm.Session, caller: Caller, body: IO[bytes], settings: Settings
) -> Job:
    """Store a job read from a JSON request body, validating as it streams (see ingest)."""
    try:
        job = _new_job(session, caller, settings)
        items = _Items(job.id, settings)
        fields: dict[str, object] = {}
        saw_items = False

        def rows() -> Iterator[tuple[object, ...]]:
            nonlocal saw_items
            for kind, value in ingest.read_body(body, max_depth=settings.max_json_depth):
                if kind == "field":
                    key, raw = value
                    fields[key] = raw
                elif kind == "items":
                    saw_items = True
                else:
                    yield items.row(items.count, ingest.parse_item(items.count, value))

        _copy(session, rows())
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
    _apply_header(session, job, header, settings)
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


def check_text_param(value: str | None, param: str) -> None:
    """A query value goes into SQL as text: PostgreSQL cannot hold NUL."""
    if value is not None and "\x00" in value:
        raise InvalidRequest(f"{param}: must not contain NUL (\\u0000)", param=param)


def fanout(job: Job, settings: Settings) -> int:
    """Task messages for a new job: one per FANOUT_ITEMS items, up to JOB_FANOUT, so that idle
    workers join a big job while a small one costs one message. A worker that already drives
    the job drops an extra message at once."""
    return max(1, min(settings.job_fanout, math.ceil(job.total / settings.fanout_items)))


def job_out(job: Job, stats: JobStats | None = None) -> JobOut:
    return JobOut(
        id=job.id,
        status=job.status.value if isinstance(job.status, JobStatus) else job.status,
        model=job.model,
        priority=job.priority,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        expires_at=job.expires_at,
        counts=Counts(
            total=job.total,
            pending=job.pending,
            running=job.running,
            succeeded=job.succeeded,
            failed=job.failed,
            cancelled=job.cancelled,
            expired=job.expired,
        ),
        usage=Usage(
            prompt_tokens=job.prompt_tokens,
            completion_tokens=job.completion_tokens,
            reasoning_tokens=job.reasoning_tokens,
        ),
        metadata=job.meta,
        error=(
            ErrorInfo(code=job.error_code, message=job.error_message or "")
            if job.error_code
            else None
        ),
        stats=stats,
    )


def job_with_stats(session: orm.Session, caller: Caller, job_id: uuid.UUID) -> JobOut:
    """One job, with its thinking statistics (thinkbatch/stats.py)."""
    job = get_job(session, caller, job_id)
    return job_out(job, stats.job_stats(session, job))


def parse_job_id(raw: str) -> uuid.UUID:
    # A batch of the OpenAI API is a job: `batch_<hex>` names the same job as its UUID.
    if raw.startswith("batch_"):
        digits = raw[len("batch_") :]
        if len(digits) != 32 or digits.strip("0123456789abcdef"):
            raise NotFound(raw)
        return uuid.UUID(digits)
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(raw) from None


def get_job(session: orm.Session, caller: Caller, job_id: uuid.UUID) -> Job:
    """The caller's job. Another tenant's job is as absent as one that never existed."""
    job = session.scalar(sa.select(Job).where(Job.id == job_id, Job.tenant == caller.tenant))
    if job is None:
        raise NotFound(str(job_id))
    return job


def list_jobs(session: orm.Session, caller: Caller, *, after: str | None, limit: int) -> JobPage:
    check_text_param(after, "after")
    query = (
        sa.select(Job)
        .where(Job.tenant == caller.tenant)
        .order_by(Job.created_at.desc(), Job.id.desc())
        .limit(limit + 1)
    )
    if after:
        anchor = session.scalar(
            sa.select(Job).where(Job.id == parse_job_id(after), Job.tenant == caller.tenant)
        )
        if anchor is None:
            raise InvalidRequest(f"after: no job {after!r}", param="after")
        query = query.where(
            sa.tuple_(Job.created_at, Job.id) < sa.tuple_(anchor.created_at, anchor.id)
        )
    jobs = list(session.scalars(query))
    page = jobs[:limit]
    return JobPage(
        data=[job_out(j) for j in page],
        has_more=len(jobs) > limit,
        last_id=page[-1].id if page else None,
    )


# Only what an item record shows: not the prompt or messages, whose JSON would be parsed for
# every row of a 100k-item download for nothing.
# Any: their own types would make a 15-column Select, which no annotation here can name.
_ITEM_COLUMNS: tuple[Any, ...] = (
    Item.seq,
    Item.custom_id,
    Item.status,
    Item.attempts,
    Item.error_code,
    Item.error_message,
    Item.started_at,
    Item.finished_at,
    ItemResult.thinking,
    ItemResult.answer,
    ItemResult.finish_reason,
    ItemResult.thinking_truncated,
    ItemResult.prompt_tokens,
    ItemResult.completion_tokens,
    ItemResult.reasoning_tokens,
)


def item_out(row: sa.Row[Any]) -> ItemOut:
    r: tuple[Any, ...] = tuple(row)
    (_, custom_id, status, attempts, error_code, error_message, started_at, finished_at,
     thinking, answer, finish_reason, truncated, prompt, completion, reasoning) = r  # fmt: skip
    status = status.value if isinstance(status, ItemStatus) else status
    return ItemOut(
        custom_id=custom_id,
        status=status,
        thinking=thinking,
        answer=answer,
        finish_reason=finish_reason,
        thinking_truncated=truncated,
        usage=(
            Usage(prompt_tokens=prompt, completion_tokens=completion, reasoning_tokens=reasoning)
            if finish_reason is not None
            else None
        ),
        attempts=attempts,
        error=(
            ErrorInfo(code=error_code, message=error_message or "")
            if error_code and status != ItemStatus.succeeded
            else None
        ),
        started_at=started_at,
        finished_at=finished_at,
    )


# Without thinking, the column is not read at all: a client downloading 100,000 answers need
# not pay for (nor receive) the reasoning; `thinking` is then null in every record.
_NO_THINKING = tuple(
    sa.null().label("thinking") if column is ItemResult.thinking else column
    for column in _ITEM_COLUMNS
)


def _items_query(
    job_id: uuid.UUID, status: ItemStatus | None, include_thinking: bool = True
) -> sa.Select[Any]:
    query = (
        sa.select(*(_ITEM_COLUMNS if include_thinking else _NO_THINKING))
        .outerjoin(ItemResult, ItemResult.item_id == Item.id)
        .where(Item.job_id == job_id)
        .order_by(Item.seq)
    )
    if status is not None:
        query = query.where(Item.status == status)
    return query


def parse_item_status(raw: str | None) -> ItemStatus | None:
    if not raw:
        return None
    try:
        return ItemStatus(raw)
    except ValueError:
        allowed = ", ".join(s.value for s in ItemStatus)
        raise InvalidRequest(f"status: must be one of {allowed}", param="status") from None


def items_page(
    session: orm.Session,
    caller: Caller,
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None,
    after: str | None,
    limit: int,
    include_thinking: bool = True,
) -> ItemPage:
    check_text_param(after, "after")
    get_job(session, caller, job_id)
    query = _items_query(job_id, status, include_thinking).limit(limit + 1)
    if after:
        seq = session.scalar(
            sa.select(Item.seq).where(Item.job_id == job_id, Item.custom_id == after)
        )
        if seq is None:
            raise InvalidRequest(f"after: no item with custom_id {after!r}", param="after")
        query = query.where(Item.seq > seq)
    rows = session.execute(query).all()
    page = rows[:limit]
    return ItemPage(
        data=[item_out(row) for row in page],
        has_more=len(rows) > limit,
        last_id=page[-1].custom_id if page else None,
    )


def iter_results(
    engine: sa.Engine,
    caller: Caller,
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None,
    include_thinking: bool = True,
    batch: int = 1000,
) -> Iterator[bytes]:
    """Every item record as one JSON line, in submission order, read through a server-side
    cursor so memory stays flat however large the job; one snapshot per download.
    The job's ownership is checked here, before the first line (NotFound otherwise)."""
    with orm.Session(engine) as session:
        get_job(session, caller, job_id)
    return _iter_results(engine, _items_query(job_id, status, include_thinking), batch)


def _iter_results(engine: sa.Engine, query: sa.Select[Any], batch: int) -> Iterator[bytes]:
    with engine.connect() as conn:
        rows = conn.execute(query.execution_options(yield_per=batch))
        buffer: list[bytes] = []
        for row in rows:
            buffer.append(item_out(row).model_dump_json().encode() + b"\n")
            if len(buffer) >= batch:
                yield b"".join(buffer)
                buffer.clear()
        if buffer:
            yield b"".join(buffer)


def cancel_job(session: orm.Session, caller: Caller, job_id: uuid.UUID) -> Job:
    get_job(session, caller, job_id)
    outcome = ledger.cancel_job(session.connection(), job_id)
    if outcome is None:
        raise NotFound(str(job_id))
    changed, status = outcome
    # Cancelling twice while the first cancel is under way is fine; a finished job is a 409.
    if not changed and status != JobStatus.cancelling:
        raise Conflict(f"job {job_id} is already {status}; only queued or running jobs cancel")
    if changed:  # when the cancel was asked, shown as a batch's `cancelling_at`
        session.execute(sa.update(Job).where(Job.id == job_id).values(cancelling_at=sa.func.now()))
    session.commit()
    job = get_job(session, caller, job_id)
    session.refresh(job)
    return job
