"""The OpenAI Batch API over jobs: a batch is a job (same tables, queue and workers) made from
an uploaded file, shown in OpenAI's `Batch` shape.

Create validates the whole input file as it streams from its chunk rows, collecting up to
MAX_BATCH_ERRORS line errors, while its items go into Postgres through the same COPY as native
jobs (thinkbatch/job_create.py `ItemRows`/`copy_items`). Any bad line rolls the items back: the
batch is stored as `failed` with its `errors` and nothing is enqueued.

Output and error files: once a batch is finished, its first read creates their file rows, with
their exact size computed by rendering the lines once (a finished job's results never change,
and rendering is deterministic, thinkbatch/openai_lines.py). Storing the rendered bytes instead
would double the results' storage for files most callers read once.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import Annotated
from typing import Any
from typing import Literal

import sqlalchemy as sa
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from sqlalchemy import orm

from thinkbatch import files
from thinkbatch import ingest
from thinkbatch import job_create
from thinkbatch import jobs
from thinkbatch import openai_lines as lines
from thinkbatch import quotas
from thinkbatch.jobs import InvalidRequest
from thinkbatch.jobs import NotFound
from thinkbatch.keys import Caller
from thinkbatch.models import TERMINAL_JOB_STATUSES
from thinkbatch.models import File
from thinkbatch.models import FileKind
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.models import Worker
from thinkbatch.schemas import JobHeader
from thinkbatch.settings import Settings

_BATCH_ID = re.compile(r"batch_([0-9a-f]{32})")
_WINDOW = re.compile(r"([1-9][0-9]{0,5})h")


class BatchNotFound(NotFound):
    pass


class ExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    anchor: Literal["created_at"]
    seconds: int = Field(ge=files.EXPIRES_MIN_S, le=files.EXPIRES_MAX_S)


class BatchCreate(BaseModel):
    """POST /v1/batches."""

    model_config = ConfigDict(extra="forbid", strict=True)
    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(
        max_length=16, description='`"<N>h"`, e.g. `"24h"`; capped by MAX_COMPLETION_WINDOW_S.'
    )
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


def batch_id(key: uuid.UUID) -> str:
    return f"batch_{key.hex}"


def parse_batch_id(raw: str) -> uuid.UUID:
    match = _BATCH_ID.fullmatch(raw)
    if match is None:
        raise BatchNotFound(raw)
    return uuid.UUID(match.group(1))


def window_seconds(text: str, settings: Settings) -> int:
    match = _WINDOW.fullmatch(text)
    if match is None:
        raise InvalidRequest(
            'completion_window: must be "<N>h", e.g. "24h"', param="completion_window"
        )
    seconds = max(1, round(int(match.group(1)) * settings.batch_hour_s))
    if seconds > settings.max_completion_window_s:
        raise InvalidRequest(
            f"completion_window: at most {settings.max_completion_window_s} seconds "
            "(MAX_COMPLETION_WINDOW_S)",
            param="completion_window",
        )
    return seconds


# --- create -----------------------------------------------------------------------------------


@dataclass
class _Validation:
    errors: list[dict[str, Any]]
    lines: int = 0


def create_batch(
    session: orm.Session,
    engine: sa.Engine,
    caller: Caller,
    spec: BatchCreate,
    *,
    idempotency_key: str | None,
    settings: Settings,
) -> tuple[Job, bool]:
    """Store a batch in the session's transaction: (the job, whether it is new). A repeated
    Idempotency-Key answers the batch it made."""
    seconds = window_seconds(spec.completion_window, settings)
    quotas.lock_tenant(session, caller.tenant)  # serializes the key's lookup and insert
    if idempotency_key is not None:
        existing = session.scalar(
            sa.select(Job).where(
                Job.tenant == caller.tenant, Job.idempotency_key == idempotency_key
            )
        )
        if existing is not None:
            # The same key means the same request: every field of it, or a 400 (a retried
            # create must not quietly return a batch that differs from what was asked).
            expires = spec.output_expires_after.seconds if spec.output_expires_after else None
            if (
                existing.endpoint,
                existing.input_file_id,
                existing.completion_window_text,
                existing.meta,
                existing.output_expires_after_s,
            ) != (
                spec.endpoint,
                _input_file(spec.input_file_id),
                spec.completion_window,
                spec.metadata,
                expires,
            ):
                raise InvalidRequest(
                    "Idempotency-Key: already used for a different batch request",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                )
            return existing, False
    upload = files.get_file(session, caller, _input_file(spec.input_file_id))
    if upload.kind != FileKind.upload or upload.purpose != "batch":
        raise InvalidRequest(
            "input_file_id: must be a file uploaded with purpose 'batch'", param="input_file_id"
        )
    job = job_create.new_job(session, caller, settings)
    job.endpoint = spec.endpoint
    job.input_file_id = upload.id
    job.completion_window_text = spec.completion_window
    job.idempotency_key = idempotency_key
    if spec.output_expires_after is not None:
        job.output_expires_after_s = spec.output_expires_after.seconds
    job.meta = dict(spec.metadata) if spec.metadata is not None else None
    session.flush()
    savepoint = session.begin_nested()
    checked = _Validation(errors=[])
    job_create.copy_items(session, _rows(engine, job, upload.id, spec.endpoint, checked, settings))
    if checked.lines == 0 and not checked.errors:
        checked.errors.append(
            {"code": "empty_file", "line": None, "message": "the input file has no requests",
             "param": None}
        )  # fmt: skip
    if checked.errors:
        savepoint.rollback()  # no item of a refused file stays
        now = datetime.now(UTC)
        job.status = JobStatus.failed
        job.finished_at = now
        job.error_code = "invalid_input_file"
        job.error_message = f"{len(checked.errors)} line(s) of the input file are invalid"
        job.batch_errors = checked.errors
        session.flush()
        session.refresh(job)
        return job, True
    savepoint.commit()
    metadata = job.meta
    header = JobHeader(metadata=metadata or {}, completion_window=seconds)
    job_create.apply_header(session, job, header, settings)
    job.meta = metadata  # as sent: none, or {} (apply_header would make both {})
    session.flush()
    return job, True


def _input_file(raw: str) -> uuid.UUID:
    try:
        return files.parse_file_id(raw)
    except files.FileNotFound:
        raise files.FileNotFound(raw) from None


def _rows(
    engine: sa.Engine,
    job: Job,
    file_key: uuid.UUID,
    endpoint: str,
    checked: _Validation,
    settings: Settings,
) -> Iterator[tuple[object, ...]]:
    """COPY rows of the file's valid lines; errors collected in `checked`. Once a line failed,
    nothing more is written (it will all be rolled back); validation goes on, to report up to
    MAX_BATCH_ERRORS lines at once."""
    items = job_create.ItemRows(job.id, settings)
    limits = ingest.Limits.of(settings, items_key=None)
    for number, raw in enumerate(
        files.iter_lines(engine, file_key, settings.max_line_bytes), start=1
    ):
        if not isinstance(raw, files.LineTooLong) and not raw.strip():
            continue
        checked.lines += 1
        try:
            if isinstance(raw, files.LineTooLong):
                raise lines.LineError(
                    f"the line is longer than {raw.limit} bytes, more than any item within "
                    "MAX_ITEM_CHARS and MAX_ITEM_VALUES can take",
                    None,
                    "line_too_long",
                )
            parsed = lines.parse_line(raw, endpoint, limits)
            if parsed.model != settings.model_name:
                raise lines.LineError(
                    f"body.model: {parsed.model!r} is not served here; this deployment serves "
                    f"{settings.model_name!r}",
                    "body.model",
                    "model_not_found",
                )
            try:
                row = items.row(items.count, parsed.item)
            except InvalidRequest as error:
                raise _line_error(error, items.count, parsed.max_tokens_param) from None
        except lines.LineError as error:
            checked.errors.append(
                {"code": error.code, "line": number, "message": error.message,
                 "param": error.param}
            )  # fmt: skip
            if len(checked.errors) >= settings.max_batch_errors:
                return
            continue
        if not checked.errors:
            yield row


def _line_error(error: InvalidRequest, index: int, max_param: str) -> lines.LineError:
    """An item check of job_create.py (`items[3].custom_id: ...`) in the line's own terms."""
    prefix = f"items[{index}]."
    old = error.param or ""
    field = old.removeprefix(prefix)
    new = {
        "custom_id": "custom_id",
        "params.max_tokens": max_param,
        "prompt": "body.prompt",
        "messages": "body.messages",
    }.get(field)
    message = error.message
    if new is not None and message.startswith(old):
        message = new + message[len(old) :]
    return lines.LineError(message, new, error.code)


# --- read -------------------------------------------------------------------------------------


def get_batch(session: orm.Session, caller: Caller, key: uuid.UUID) -> Job:
    job = session.scalar(
        sa.select(Job).where(Job.id == key, Job.tenant == caller.tenant, Job.endpoint.is_not(None))
    )
    if job is None:
        raise BatchNotFound(batch_id(key))
    return job


def list_batches(
    session: orm.Session, caller: Caller, *, after: str | None, limit: int
) -> dict[str, Any]:
    query = sa.select(Job).where(Job.tenant == caller.tenant, Job.endpoint.is_not(None))
    if after:
        match = _BATCH_ID.fullmatch(after)
        anchor = (
            session.scalar(
                sa.select(Job).where(
                    Job.id == uuid.UUID(match.group(1)), Job.tenant == caller.tenant
                )
            )
            if match
            else None
        )
        if anchor is None:
            raise InvalidRequest(f"after: no batch {after!r}", param="after")
        query = query.where(
            sa.tuple_(Job.created_at, Job.id) < sa.tuple_(anchor.created_at, anchor.id)
        )
    found = list(
        session.scalars(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1))
    )
    data = [batch_out(job) for job in found[:limit]]
    return files.page(data, has_more=len(found) > limit)


def cancel_batch(session: orm.Session, caller: Caller, key: uuid.UUID) -> Job:
    """A finished batch is a 400, not the jobs API's 409: the OpenAI SDK retries 409s."""
    job = get_batch(session, caller, key)
    if job.status in TERMINAL_JOB_STATUSES:
        raise InvalidRequest(
            f"batch {batch_id(key)} is already {job.status}; only a batch in progress cancels",
            param=None,
            code="batch_not_cancellable",
        )
    try:
        return jobs.cancel_job(session, caller, key)
    except jobs.Conflict as error:  # finished between the read and the lock
        raise InvalidRequest(str(error), code="batch_not_cancellable") from None


def _unix(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def batch_out(job: Job) -> dict[str, Any]:
    """The job as an OpenAI `Batch`. A finished batch whose output files are not made yet is
    `finalizing` (OpenAI's word for it): they are made by whatever finished it, or the sweeper
    (make_files), never by a read."""
    status = job.status.value if isinstance(job.status, JobStatus) else str(job.status)
    refused = job.batch_errors is not None
    finalizing = status in _ENDED and not refused and job.output_file_id is None
    shown = "in_progress" if status in ("queued", "running") else status
    ended: dict[str, int | None] = dict.fromkeys(_ENDED)
    if finalizing:
        shown = "finalizing"
    elif status in ended:
        ended[status] = _unix(job.finished_at)
    return {
        "id": batch_id(job.id),
        "object": "batch",
        "endpoint": job.endpoint,
        "model": job.model,
        "errors": {"object": "list", "data": job.batch_errors} if refused else None,
        "input_file_id": files.file_id(job.input_file_id) if job.input_file_id else "",
        "completion_window": job.completion_window_text or "24h",
        "status": shown,
        "output_file_id": files.file_id(job.output_file_id) if job.output_file_id else None,
        "error_file_id": files.file_id(job.error_file_id) if job.error_file_id else None,
        "created_at": _unix(job.created_at),
        "in_progress_at": None if refused else _unix(job.created_at),
        "expires_at": _unix(job.expires_at),
        "finalizing_at": _unix(job.finished_at) if status in _ENDED and not refused else None,
        "completed_at": ended["completed"],
        "failed_at": ended["failed"],
        "expired_at": ended["expired"],
        "cancelling_at": _unix(job.cancelling_at),
        "cancelled_at": ended["cancelled"],
        "request_counts": {
            "total": job.total,
            "completed": job.succeeded,
            "failed": job.failed + job.cancelled + job.expired,
        },
        "usage": {
            "input_tokens": job.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": job.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": job.reasoning_tokens},
            "total_tokens": job.prompt_tokens + job.completion_tokens,
        },
        "metadata": job.meta,
    }


_ENDED = ("completed", "failed", "cancelled", "expired")


# --- output files -----------------------------------------------------------------------------

# Jobs a call of make_due_files takes at most: each is rendered once to size its files.
DUE_FILES_PER_CALL = 20


def make_due_files(engine: sa.Engine, limit: int = DUE_FILES_PER_CALL) -> int:
    """Make the output files of finished batches that have none yet; returns how many."""
    with engine.connect() as conn:
        due = list(
            conn.execute(
                sa.select(Job.id)
                .where(
                    Job.endpoint.is_not(None),
                    Job.output_file_id.is_(None),
                    Job.batch_errors.is_(None),
                    Job.status.in_(TERMINAL_JOB_STATUSES),
                )
                .order_by(Job.finished_at)
                .limit(limit)
            ).scalars()
        )
    return sum(make_files(engine, job_id) for job_id in due)


def make_files(engine: sa.Engine, job_id: uuid.UUID) -> bool:
    """Create the output file (and, if any item did not succeed, the error file) of a finished
    batch, once. Their exact sizes come from rendering the lines (a finished job's results
    never change, and rendering is deterministic), done before the job row is locked; the row
    lock then makes sure that only one process stores them."""
    with orm.Session(engine) as session:
        job = session.get(Job, job_id)
        if job is None or job.output_file_id is not None or job.endpoint is None:
            return False
        if job.status not in TERMINAL_JOB_STATUSES or job.batch_errors is not None:
            return False
        kinds = [FileKind.output]
        if job.failed + job.cancelled + job.expired > 0:
            kinds.append(FileKind.error)
        sizes = {kind: sum(len(chunk) for chunk in _render(engine, job, kind)) for kind in kinds}
    with orm.Session(engine) as session, session.begin():
        locked = session.scalar(sa.select(Job).where(Job.id == job_id).with_for_update())
        if locked is None or locked.output_file_id is not None:
            return False
        now = datetime.now(UTC)
        made: dict[FileKind, uuid.UUID] = {}
        for kind, size in sizes.items():
            record = File(
                id=uuid.uuid4(),
                tenant=locked.tenant,
                kind=kind,
                purpose="batch_output",
                filename=f"{batch_id(locked.id)}_{kind.value}.jsonl",
                bytes=size,
                job_id=locked.id,
                created_at=now,
                expires_at=(
                    now + timedelta(seconds=locked.output_expires_after_s)
                    if locked.output_expires_after_s
                    else None
                ),
            )
            session.add(record)
            made[kind] = record.id
        locked.output_file_id = made[FileKind.output]
        locked.error_file_id = made.get(FileKind.error)
    return True


_ROW_COLUMNS = (
    Item.id,
    Item.custom_id,
    Item.status,
    Item.error_code,
    Item.error_message,
    Item.finished_at,
    ItemResult.thinking,
    ItemResult.answer,
    ItemResult.finish_reason,
    ItemResult.thinking_truncated,
    ItemResult.prompt_tokens,
    ItemResult.completion_tokens,
    ItemResult.reasoning_tokens,
)


def _render(engine: sa.Engine, job: Job, kind: FileKind, batch: int = 1000) -> Iterator[bytes]:
    query = (
        sa.select(*_ROW_COLUMNS)
        .outerjoin(ItemResult, ItemResult.item_id == Item.id)
        .where(Item.job_id == job.id)
        .order_by(Item.seq)
        .execution_options(yield_per=batch)
    )
    if kind == FileKind.output:
        query = query.where(Item.status == "succeeded")
    else:
        query = query.where(Item.status != "succeeded")
    endpoint, model = job.endpoint or lines.CHAT, job.model
    with engine.connect() as conn:
        buffer: list[bytes] = []
        for r in conn.execute(query):
            status = r.status.value if hasattr(r.status, "value") else str(r.status)
            row = lines.Row(
                r.id, r.custom_id, status, r.error_code, r.error_message, _unix(r.finished_at),
                r.thinking, r.answer, r.finish_reason, r.thinking_truncated, r.prompt_tokens,
                r.completion_tokens, r.reasoning_tokens,
            )  # fmt: skip
            buffer.append(lines.render(row, endpoint=endpoint, model=model))
            if len(buffer) >= batch:
                yield b"".join(buffer)
                buffer.clear()
        if buffer:
            yield b"".join(buffer)


def open_file(engine: sa.Engine, caller: Caller, key: uuid.UUID) -> tuple[int, Iterator[bytes]]:
    """A file's size and content: an upload's chunks, or a batch's rendered lines (whose size
    was measured when they were made). The file's ownership is checked here, before the first
    byte (FileNotFound otherwise)."""
    with orm.Session(engine) as session:
        found = files.get_file(session, caller, key)
        job = session.get(Job, found.job_id) if found.job_id else None
        kind, size = found.kind, found.bytes
    if job is None:
        return size, files.iter_chunks(engine, key)
    return size, _render(engine, job, FileKind(kind))


# --- models -----------------------------------------------------------------------------------


def served_models(session: orm.Session, settings: Settings) -> dict[str, Any]:
    """The models that live workers serve (known from their heartbeats), as OpenAI's list."""
    since = datetime.now(UTC) - timedelta(seconds=settings.worker_dead_after_s)
    rows = session.execute(
        sa.select(Worker.model, sa.func.min(Worker.started_at))
        .where(Worker.stopped_at.is_(None), Worker.heartbeat_at > since)
        .group_by(Worker.model)
        .order_by(Worker.model)
    ).all()
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": _unix(started), "owned_by": "thinkbatch"}
            for model, started in rows
        ],
    }
