"""Jobs as a service: create, read, page, stream, cancel. The REST API is a thin layer over this,
and so will be the OpenAI Batch facade and the CLI.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from datetime import UTC
from datetime import datetime
from datetime import timedelta

import sqlalchemy as sa
from pydantic import ValidationError
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.schemas import Counts
from thinkbatch.schemas import ErrorInfo
from thinkbatch.schemas import ItemOut
from thinkbatch.schemas import ItemPage
from thinkbatch.schemas import JobCreate
from thinkbatch.schemas import JobOut
from thinkbatch.schemas import JobPage
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


def field_path(loc: tuple[int | str, ...]) -> str:
    """('items', 3, 'messages', 0, 'role') -> 'items[3].messages[0].role'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def parse_job(body: bytes, settings: Settings) -> JobCreate:
    """Validate a request body fully before anything is stored."""
    try:
        spec = JobCreate.model_validate_json(body)
    except ValidationError as error:
        first = error.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise InvalidRequest(
                f"request body is not valid JSON: {first['msg']}", code="invalid_json"
            ) from None
        loc = tuple(part for part in first["loc"] if part not in ("function-after",))
        # Union branches show up in the location as type names; they say nothing to a user.
        loc = tuple(p for p in loc if not (isinstance(p, str) and p in ("str", "list[str]")))
        param = field_path(loc) or None
        message = first["msg"]
        if message.startswith("Value error, "):
            message = message[len("Value error, ") :]
        text = f"{param}: {message}" if param else message
        raise InvalidRequest(text, param=param, code=first["type"]) from None
    check_job(spec, settings)
    return spec


def check_job(spec: JobCreate, settings: Settings) -> None:
    """Checks that depend on settings or span several items."""
    if spec.model is not None and spec.model != settings.model_name:
        raise InvalidRequest(
            f"model: unknown model {spec.model!r}; this deployment serves {settings.model_name!r}",
            param="model",
            code="model_not_found",
        )
    if len(spec.items) > settings.max_items_per_job:
        raise InvalidRequest(
            f"items: {len(spec.items)} items, more than the limit of {settings.max_items_per_job}",
            param="items",
            code="too_many_items",
        )
    if spec.completion_window is not None and (
        spec.completion_window > settings.max_completion_window_s
    ):
        raise InvalidRequest(
            f"completion_window: at most {settings.max_completion_window_s} seconds",
            param="completion_window",
        )
    _check_max_tokens(spec.params.max_tokens, "params.max_tokens", settings)
    seen: dict[str, int] = {}
    for index, item in enumerate(spec.items):
        if item.params is not None:
            _check_max_tokens(item.params.max_tokens, f"items[{index}].params.max_tokens", settings)
        if item.custom_id is None:
            continue
        first = seen.setdefault(item.custom_id, index)
        if first != index:
            raise InvalidRequest(
                f"items[{index}].custom_id: duplicate custom_id {item.custom_id!r} "
                f"(first used by items[{first}])",
                param=f"items[{index}].custom_id",
                code="duplicate_custom_id",
            )


def _check_max_tokens(value: int | None, param: str, settings: Settings) -> None:
    if value is not None and value > settings.max_tokens_cap:
        raise InvalidRequest(
            f"{param}: {value} is above the cap of {settings.max_tokens_cap}",
            param=param,
            code="max_tokens_too_large",
        )


def _custom_ids(spec: JobCreate) -> list[str]:
    given = {item.custom_id for item in spec.items if item.custom_id is not None}
    ids: list[str] = []
    for index, item in enumerate(spec.items):
        if item.custom_id is not None:
            ids.append(item.custom_id)
            continue
        candidate = f"item-{index}"
        while candidate in given:  # never collide with an id the user chose
            candidate += "_"
        given.add(candidate)
        ids.append(candidate)
    return ids


def create_job(session: orm.Session, spec: JobCreate, settings: Settings) -> Job:
    """Store the job and all its items in the session's transaction (COPY for the items)."""
    now = datetime.now(UTC)
    window = spec.completion_window or settings.default_completion_window_s
    job = Job(
        id=uuid.uuid4(),
        status=JobStatus.queued,
        model=settings.model_name,
        params=spec.params.overrides(),
        meta=dict(spec.metadata),
        priority=spec.priority,
        created_at=now,
        expires_at=now + timedelta(seconds=window),
    )
    session.add(job)
    session.flush()
    driver = session.connection().connection.driver_connection
    assert driver is not None
    copy_sql = "COPY items (job_id, seq, custom_id, messages, prompt, params, status) FROM STDIN"
    with driver.cursor() as cursor, cursor.copy(copy_sql) as copy:
        for seq, (item, custom_id) in enumerate(zip(spec.items, _custom_ids(spec), strict=True)):
            messages = (
                json.dumps([m.model_dump() for m in item.messages], ensure_ascii=False)
                if item.messages is not None
                else None
            )
            params = item.params.overrides() if item.params is not None else None
            copy.write_row(
                (
                    job.id,
                    seq,
                    custom_id,
                    messages,
                    item.prompt,
                    json.dumps(params) if params else None,
                    ItemStatus.pending.value,
                )
            )
    session.refresh(job)  # counters come from the insert trigger
    return job


def fanout(job: Job, settings: Settings) -> int:
    """Task messages for a new job: one per engine window of items, up to JOB_FANOUT, so that
    several workers share a big job while a small one costs one message."""
    return max(1, min(settings.job_fanout, math.ceil(job.total / settings.inflight_window)))


def job_out(job: Job) -> JobOut:
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
    )


def parse_job_id(raw: str) -> uuid.UUID:
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(raw) from None


def get_job(session: orm.Session, job_id: uuid.UUID) -> Job:
    job = session.get(Job, job_id)
    if job is None:
        raise NotFound(str(job_id))
    return job


def list_jobs(session: orm.Session, *, after: str | None, limit: int) -> JobPage:
    query = sa.select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)
    if after:
        anchor = session.get(Job, parse_job_id(after))
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


def item_out(item: Item, result: ItemResult | None) -> ItemOut:
    return ItemOut(
        custom_id=item.custom_id,
        status=item.status.value if isinstance(item.status, ItemStatus) else item.status,
        thinking=result.thinking if result else None,
        answer=result.answer if result else None,
        finish_reason=result.finish_reason if result else None,
        thinking_truncated=result.thinking_truncated if result else None,
        usage=(
            Usage(
                prompt_tokens=result.prompt_tokens,
                completion_tokens=result.completion_tokens,
                reasoning_tokens=result.reasoning_tokens,
            )
            if result
            else None
        ),
        attempts=item.attempts,
        error=(
            ErrorInfo(code=item.error_code, message=item.error_message or "")
            if item.error_code and item.status != ItemStatus.succeeded
            else None
        ),
        started_at=item.started_at,
        finished_at=item.finished_at,
    )


def _items_query(
    job_id: uuid.UUID, status: ItemStatus | None
) -> sa.Select[tuple[Item, ItemResult]]:
    query = (
        sa.select(Item, ItemResult)
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
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None,
    after: str | None,
    limit: int,
) -> ItemPage:
    get_job(session, job_id)
    query = _items_query(job_id, status).limit(limit + 1)
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
        data=[item_out(item, result) for item, result in page],
        has_more=len(rows) > limit,
        last_id=page[-1][0].custom_id if page else None,
    )


def iter_results(
    engine: sa.Engine, job_id: uuid.UUID, *, status: ItemStatus | None, batch: int = 1000
) -> Iterator[bytes]:
    """Every item record as one JSON line, in submission order, read through a server-side
    cursor so memory stays flat however large the job; one snapshot per download."""
    with orm.Session(engine) as session:
        rows = session.execute(_items_query(job_id, status).execution_options(yield_per=batch))
        buffer: list[bytes] = []
        for item, result in rows:
            buffer.append(item_out(item, result).model_dump_json().encode() + b"\n")
            if len(buffer) >= batch:
                yield b"".join(buffer)
                buffer.clear()
        if buffer:
            yield b"".join(buffer)


def cancel_job(session: orm.Session, job_id: uuid.UUID) -> Job:
    outcome = ledger.cancel_job(session.connection(), job_id)
    if outcome is None:
        raise NotFound(str(job_id))
    changed, status = outcome
    # Cancelling twice while the first cancel is under way is fine; a finished job is a 409.
    if not changed and status != JobStatus.cancelling:
        raise Conflict(f"job {job_id} is already {status}; only queued or running jobs cancel")
    session.commit()
    job = get_job(session, job_id)
    session.refresh(job)
    return job
