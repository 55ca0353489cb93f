"""Reading jobs: one job, a page of jobs, a page of a job's items, all its records as JSONL,
and when its items finished. Every query is scoped by the caller's tenant: another tenant's job
is as absent as one that never existed. Nothing here writes.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.db import Prepared
from thinkbatch.errors import InputError
from thinkbatch.errors import NotFound
from thinkbatch.jobs import results
from thinkbatch.jobs.wire import Counts
from thinkbatch.jobs.wire import ErrorInfo
from thinkbatch.jobs.wire import ItemOut
from thinkbatch.jobs.wire import ItemPage
from thinkbatch.jobs.wire import JobOut
from thinkbatch.jobs.wire import JobPage
from thinkbatch.jobs.wire import JobStats
from thinkbatch.jobs.wire import Usage
from thinkbatch.keys import Caller
from thinkbatch.ledger import ModelFilter
from thinkbatch.models import Item
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus

_BATCH_PREFIX = "batch_"


@dataclass(frozen=True, slots=True)
class JobRecord:
    """What a job's record shows, read as plain columns (status_record): a poll builds no ORM
    object. Its counts come from the Job attributes themselves, so they are computed in one
    place however Job defines them."""

    id: uuid.UUID
    status: str  # a JobStatus's value, as stored
    model: str
    models: list[str]
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    expires_at: datetime
    total: int
    pending: int
    running: int
    succeeded: int
    failed: int
    cancelled: int
    expired: int
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    meta: dict[str, Any] | None
    error_code: str | None
    error_message: str | None


_RECORD = Prepared(
    sa.select(
        Job.id,
        Job.status,
        Job.model,
        Job.models,
        Job.priority,
        Job.created_at,
        Job.started_at,
        Job.finished_at,
        Job.expires_at,
        Job.total,
        Job.pending,
        Job.running,
        Job.succeeded,
        Job.failed,
        Job.cancelled,
        Job.expired,
        Job.prompt_tokens,
        Job.completion_tokens,
        Job.reasoning_tokens,
        Job.meta,
        Job.error_code,
        Job.error_message,
    ).where(Job.id == sa.bindparam("job_id"), Job.tenant == sa.bindparam("tenant"))
)


def job_record(conn: sa.Connection, caller: Caller, job_id: uuid.UUID) -> JobRecord:
    """The caller's job as a JobRecord (NotFound as get_job), by one statement built once."""
    row = _RECORD.first(conn, job_id=job_id, tenant=caller.tenant)
    if row is None:
        raise NotFound(str(job_id))
    return JobRecord(*row)


def waiting_for(conn: sa.Connection, job: Job | JobRecord, live: dict[str, int]) -> list[str]:
    """The models of the job's pending items that no live worker serves (`live`: the live
    workers by served name, fleet.live_workers). A mixed job's model counts only while it has
    pending items; the lookups run only for a model nobody serves."""
    if job.pending <= 0:
        return []
    models = job.models or [job.model]
    idle = [m for m in models if not live.get(m)]
    if len(models) <= 1 or not idle:
        return idle
    # As a worker of that one model asks (an item of the job's own model names none): from the
    # pending index by name, not by filtering the job's pending items, which a poll of a big
    # mixed job would read whole once the model's own are done.
    return [
        m for m in idle if ledger.has_pending(conn, job.id, ModelFilter.of(job.model, models, [m]))
    ]


def job_out(
    job: Job | JobRecord, stats: JobStats | None = None, waiting: list[str] | None = None
) -> JobOut:
    """The job's record; `waiting`: the models it waits for (waiting_for)."""
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
        waiting_for=waiting or [],
    )


def parse_job_id(raw: str) -> uuid.UUID:
    """A job id, as a UUID or as the `batch_<hex>` the OpenAI API names the same job by."""
    if raw.startswith(_BATCH_PREFIX):
        digits = raw[len(_BATCH_PREFIX) :]
        if len(digits) != 32 or digits.strip("0123456789abcdef"):
            raise NotFound(raw)
        return uuid.UUID(digits)
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise NotFound(raw) from None


def parse_item_status(raw: str | None) -> ItemStatus | None:
    if raw is None:
        return None
    try:
        return ItemStatus(raw)
    except ValueError:
        allowed = ", ".join(s.value for s in ItemStatus)
        raise InputError(f"status: must be one of {allowed}", param="status") from None


def get_job(session: orm.Session, caller: Caller, job_id: uuid.UUID) -> Job:
    """The caller's job. Another tenant's job is as absent as one that never existed."""
    job = session.scalar(sa.select(Job).where(Job.id == job_id, Job.tenant == caller.tenant))
    if job is None:
        raise NotFound(str(job_id))
    return job


def list_jobs(
    session: orm.Session,
    caller: Caller,
    *,
    after: uuid.UUID | None,
    limit: int,
    batches_only: bool = False,
) -> tuple[list[Job], bool]:
    """A page of the caller's jobs, newest first, after the job `after`; and whether more
    follow. `batches_only`: only the jobs made through the OpenAI Batch API."""
    query = sa.select(Job).where(Job.tenant == caller.tenant)
    if batches_only:
        query = query.where(Job.endpoint.is_not(None))
    if after is not None:
        # The anchor is one of the jobs listed: a native job is no cursor of the batches.
        anchor = session.scalar(query.where(Job.id == after))
        if anchor is None:
            raise InputError(f"after: no job {str(after)!r}", param="after")
        query = query.where(
            sa.tuple_(Job.created_at, Job.id) < sa.tuple_(anchor.created_at, anchor.id)
        )
    found = list(
        session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1))
    )
    return found[:limit], len(found) > limit


def job_page(jobs: list[Job], has_more: bool, waiting: list[list[str]] | None = None) -> JobPage:
    return JobPage(
        data=[job_out(j, waiting=waiting[k] if waiting else None) for k, j in enumerate(jobs)],
        has_more=has_more,
        last_id=jobs[-1].id if jobs else None,
    )


_SEQ_OF = Prepared(
    sa.select(Item.seq).where(
        Item.job_id == sa.bindparam("job_id"), Item.custom_id == sa.bindparam("custom_id")
    )
)


def items_page(
    conn: sa.Connection,
    caller: Caller,
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None,
    after: str | None,
    limit: int,
    include_thinking: bool = True,
) -> ItemPage:
    """A page of the caller's job's item records. Plain statements, each its own snapshot on
    an autocommit connection (JobService.reads): a job's owner, its items' custom ids and
    their order never change, so the page needs no transaction around them."""
    job_record(conn, caller, job_id)  # the caller's, or NotFound
    start = -1  # the seq the page starts after
    if after:
        found_seq = _SEQ_OF.first(conn, job_id=job_id, custom_id=after)
        if found_seq is None:
            raise InputError(f"after: no item with custom_id {after!r}", param="after")
        start = found_seq[0]
    args: dict[str, object] = {"job_id": job_id, "start": start, "limit": limit + 1}
    if status is None:
        # A job's items take the places 0, 1, 2, ... of its submission, so the next page of
        # them lies in the next limit + 1 places: ask for those (with the LIMIT as well, which
        # keeps the plan to index lookups of those rows). Asked for the rest of the job in
        # order, the planner, which takes a job its statistics have not seen (the one just
        # submitted, among smaller ones) for a single row, read and sorted the whole job for
        # each page: 26 ms against 0.2 ms for a page of a 20,000-item job here. Were places
        # ever missing, what the window lacks is asked for after it.
        end = start + limit + 1
        window = results.page_statement(
            include_thinking=include_thinking, by_status=False, window=True
        )
        found = window.all(conn, **args, end=end)
        if len(found) < limit + 1:
            rest = results.page_statement(
                include_thinking=include_thinking, by_status=False, window=False
            )
            found += rest.all(conn, **{**args, "start": end, "limit": limit + 1 - len(found)})
    else:
        statement = results.page_statement(
            include_thinking=include_thinking, by_status=True, window=False
        )
        found = statement.all(conn, **args, status=status.value)
    rows = [results.row(r) for r in found]
    page = rows[:limit]
    return ItemPage(
        data=[r.item_out() for r in page],
        has_more=len(rows) > limit,
        last_id=page[-1].custom_id if page else None,
    )


def jsonl(rows: Iterator[results.ResultRow], batch: int = 1000) -> Iterator[bytes]:
    """Item records as JSON lines, in chunks of `batch` lines."""
    buffer: list[bytes] = []
    # The serializer's bytes as they are (model_dump_json decodes them to a str first).
    to_json = ItemOut.__pydantic_serializer__.to_json
    for r in rows:
        buffer.append(to_json(r.item_out()) + b"\n")
        if len(buffer) >= batch:
            yield b"".join(buffer)
            buffer.clear()
    if buffer:
        yield b"".join(buffer)


def finished_times(session: orm.Session, job_id: uuid.UUID) -> list[datetime]:
    """When each of the job's finished items finished, in order (the dashboard's timeline)."""
    return [
        t
        for t in session.scalars(
            sa.select(Item.finished_at)
            .where(Item.job_id == job_id, Item.finished_at.is_not(None))
            .order_by(Item.finished_at)
        )
        if t is not None
    ]
