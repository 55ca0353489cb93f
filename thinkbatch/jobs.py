"""Jobs as a service: read, page, stream, cancel, and the errors every job service raises
(creating them is thinkbatch/job_create.py). The REST API, the OpenAI Batch facade and the
CLI are thin layers over these.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch import stats
from thinkbatch.keys import Caller
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.schemas import Counts
from thinkbatch.schemas import ErrorInfo
from thinkbatch.schemas import ItemOut
from thinkbatch.schemas import ItemPage
from thinkbatch.schemas import JobOut
from thinkbatch.schemas import JobPage
from thinkbatch.schemas import JobStats
from thinkbatch.schemas import Usage


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


def check_text_param(value: str | None, param: str) -> None:
    """A query value goes into SQL as text: PostgreSQL cannot hold NUL."""
    if value is not None and "\x00" in value:
        raise InvalidRequest(f"{param}: must not contain NUL (\\u0000)", param=param)


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
        metadata=job.meta or {},
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
