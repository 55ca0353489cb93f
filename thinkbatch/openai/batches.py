"""The OpenAI Batch API over the job service: a batch is a job (same tables, queue and workers)
made from an uploaded file, shown in OpenAI's `Batch` shape. This module uses the job service's
front door (thinkbatch/jobs) and nothing behind it.

Create validates the whole input file as it streams from its chunk rows, collecting up to
MAX_BATCH_ERRORS line errors, while the valid lines go into the job's items. As OpenAI does, a
line that is not a request of this batch (lines.py) refuses the file: the items are rolled back,
and the batch is stored `failed` with its errors. A line whose request body is at fault is that
request's failure alone: it is stored as a failed item (a RefusedItem), counted failed, and
answered in the error file; the batch runs the others, and one whose every line was refused is
completed at once, its files made then.

Output and error files are made when a batch finishes (`make_files`: by the worker that
finished it, the cancel that ended it, the read that expired it, or the sweeper): until then
the batch is `finalizing`. Their sizes come from rendering the lines once (a finished job's
results never change, and rendering is deterministic, lines.py); storing the rendered bytes
instead would double the results' storage for files most callers read once.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.db import reads
from thinkbatch.errors import BatchNotFound
from thinkbatch.errors import Conflict
from thinkbatch.errors import FileNotFound
from thinkbatch.errors import InputError
from thinkbatch.errors import NotFound
from thinkbatch.guard import Limits
from thinkbatch.guard import is_blank
from thinkbatch.jobs import ItemIn
from thinkbatch.jobs import JobHeader
from thinkbatch.jobs import JobService
from thinkbatch.jobs import Origin
from thinkbatch.jobs import RefusedItem
from thinkbatch.jobs import Submitted
from thinkbatch.jobs import digest_of
from thinkbatch.jobs import result_rows
from thinkbatch.keys import Caller
from thinkbatch.models import TERMINAL_JOB_STATUSES
from thinkbatch.models import FileKind
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.models import Worker
from thinkbatch.openai import files
from thinkbatch.openai import lines
from thinkbatch.openai.wire import Batch
from thinkbatch.openai.wire import BatchCreate
from thinkbatch.openai.wire import BatchList
from thinkbatch.openai.wire import ModelList
from thinkbatch.settings import Settings

_BATCH_ID = re.compile(r"batch_([0-9a-f]{32})")
_WINDOW = re.compile(r"([1-9][0-9]{0,5})h")
_ENDED = ("completed", "failed", "cancelled", "expired")


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
        raise InputError('completion_window: must be "<N>h", e.g. "24h"', param="completion_window")
    seconds = max(1, round(int(match.group(1)) * settings.batch_hour_s))
    if seconds > settings.max_completion_window_s:
        raise InputError(
            f"completion_window: at most {settings.max_completion_window_s} seconds "
            "(MAX_COMPLETION_WINDOW_S)",
            param="completion_window",
        )
    return seconds


# --- create -----------------------------------------------------------------------------------


class _Refused(Exception):
    """The file has bad lines: nothing of it is stored but the failed batch."""


# The job service's item errors that are faults of the file, not of one request.
_FILE_CODES = frozenset({"duplicate_custom_id", "too_many_items"})


class _Lines:
    """The file's lines as items (or refused items); each error of the file collected, with
    its line number."""

    def __init__(self, jobs: JobService, file_key: uuid.UUID, endpoint: str):
        self.jobs = jobs
        self.file_key = file_key
        self.endpoint = endpoint
        self.errors: list[dict[str, Any]] = []
        self.lines = 0
        self.number = 0  # the line being read
        # The line last offered: the job service checks each item as it is offered, before
        # the next is read, so its errors concern this line.
        self.current: lines.ParsedLine | None = None
        self.fleet = jobs.fleet()

    def items(self) -> Iterator[ItemIn | RefusedItem]:
        settings = self.jobs.settings
        limits = Limits.of(settings, items_key=None)
        for number, raw in enumerate(
            files.iter_lines(self.jobs.engine, self.file_key, settings.max_line_bytes), start=1
        ):
            if not isinstance(raw, files.LineTooLong) and is_blank(raw):
                continue
            self.number = number
            self.lines += 1
            try:
                if isinstance(raw, files.LineTooLong):
                    raise InputError(
                        f"the line is longer than {raw.limit} bytes, more than an item "
                        "within MAX_ITEM_CHARS and MAX_ITEM_VALUES takes unpadded",
                        code="line_too_long",
                    )
                parsed = lines.parse_line(raw, self.endpoint, limits)
                # A model no configuration names and no worker serves fails the file, as
                # OpenAI refuses a file that names a model it does not have. A file may mix the
                # models served here: each line runs on its own model's workers.
                if parsed.model is not None:
                    self.fleet.check(parsed.model, "body.model")
            except InputError as error:
                self.error(error)
                if len(self.errors) >= settings.max_batch_errors:
                    break
                continue
            self.current = parsed
            if parsed.model is not None and isinstance(parsed.item, ItemIn):
                yield parsed.item.model_copy(update={"model": parsed.model})
            else:
                yield parsed.item
            if len(self.errors) >= settings.max_batch_errors:
                break
        if self.lines == 0 and not self.errors:
            self.errors.append(
                {"code": "empty_file", "line": None, "message": "the input file has no requests",
                 "param": None}
            )  # fmt: skip
        if self.errors:
            raise _Refused()

    def item_error(
        self, index: int, item: ItemIn | RefusedItem, error: InputError
    ) -> RefusedItem | None:
        """An item check of the job service, in the line's own terms (`items[3].prompt` is
        `body.prompt` there): a fault of the request refuses the line alone (returned), one
        of the file (a duplicate custom_id, too many lines) is collected."""
        prefix = f"items[{index}]"
        error = error.renamed(f"{prefix}.custom_id", "custom_id")
        for old, new in ((".params", ""), (".prompt", ".prompt"), (".messages", ".messages")):
            error = error.renamed(prefix + old, "body" + new)
        error = error.renamed(prefix, "body")
        if f"for {prefix}" in error.message:  # a limit's message names the item it measured
            error = InputError(
                error.message.replace(f"for {prefix}", "for this request"),
                param=error.param,
                code=error.code,
            )
        if error.code in _FILE_CODES or isinstance(item, RefusedItem) or self.current is None:
            self.error(error)
            return None
        assert item.custom_id == self.current.custom_id
        return lines.refusal(
            self.current.custom_id, error, self.current.renames, self.current.model
        )

    def error(self, error: InputError) -> None:
        self.errors.append(
            {"code": error.code, "line": self.number, "message": error.message,
             "param": error.param}
        )  # fmt: skip


def create_batch(
    jobs: JobService, caller: Caller, spec: BatchCreate, *, idempotency_key: str | None
) -> Submitted:
    """Store a batch; a repeated Idempotency-Key with the same request answers the batch it
    made (`replayed`), and with another request is a 400."""
    settings = jobs.settings
    seconds = window_seconds(spec.completion_window, settings)
    digest = digest_of(spec.model_dump_json().encode())
    with jobs.read_sessions() as session:
        try:
            upload = files.get_file(session, caller, files.parse_file_id(spec.input_file_id))
        except FileNotFound:
            raise FileNotFound(spec.input_file_id, param="input_file_id") from None
        if upload.kind != FileKind.upload or upload.purpose != "batch":
            raise InputError(
                "input_file_id: must be a file uploaded with purpose 'batch'",
                param="input_file_id",
            )
    origin = Origin(
        endpoint=spec.endpoint,
        input_file_id=upload.id,
        completion_window_text=spec.completion_window,
        output_expires_after_s=(
            spec.output_expires_after.seconds if spec.output_expires_after else None
        ),
    )
    header = JobHeader(metadata=spec.metadata, completion_window=seconds)
    read = _Lines(jobs, upload.id, spec.endpoint)
    try:
        made = jobs.submit(
            caller,
            read.items(),
            header,
            origin=origin,
            idempotency_key=idempotency_key,
            digest=digest,
            item_errors=read.item_error,
            refused=lambda: bool(read.errors),
        )
    except _Refused:
        made = jobs.record_refused(
            caller,
            header,
            read.errors,
            origin=origin,
            idempotency_key=idempotency_key,
            digest=digest,
        )
        return made
    # Every line refused: the job finished as it was stored, and nothing else will make its
    # files.
    if made.job.status in TERMINAL_JOB_STATUSES and make_files(jobs.engine, made.job.id):
        return Submitted(jobs.get(caller, made.job.id), replayed=made.replayed)
    return made


# --- read -------------------------------------------------------------------------------------


def get_batch(jobs: JobService, caller: Caller, key: uuid.UUID) -> Job:
    """The caller's batch: a job of another tenant, none at all and a native job alike are
    no batch of that id (the batch's own error, naming the id asked for)."""
    try:
        job = jobs.get(caller, key)  # scoped by tenant
    except NotFound:
        raise BatchNotFound(batch_id(key)) from None
    if job.endpoint is None:
        raise BatchNotFound(batch_id(key))
    if (
        job.status == JobStatus.expired
        and job.output_file_id is None
        and make_files(jobs.engine, key)
    ):
        # Expired by this read (JobService.get: no worker's sweeper may be alive to do it),
        # it gets its files as a cancel's batch does.
        job = jobs.get(caller, key)
    return job


def list_batches(jobs: JobService, caller: Caller, *, after: str | None, limit: int) -> BatchList:
    anchor = None
    if after is not None:
        match = _BATCH_ID.fullmatch(after)
        if match is None:
            raise InputError(f"after: no batch {after!r}", param="after")
        anchor = uuid.UUID(match.group(1))
    try:
        found, more = jobs.list_jobs(caller, after=anchor, limit=limit, batches_only=True)
    except InputError:
        raise InputError(f"after: no batch {after!r}", param="after") from None
    data = [batch_view(job) for job in found]
    return BatchList(
        object="list",
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=more,
    )


def cancel_batch(jobs: JobService, caller: Caller, key: uuid.UUID) -> Job:
    """A finished batch is a 400, not the jobs API's 409: the OpenAI SDK retries 409s. A batch
    with nothing running ends at once, and its files are made then."""
    job = get_batch(jobs, caller, key)
    if job.status in TERMINAL_JOB_STATUSES:
        raise InputError(
            f"batch {batch_id(key)} is already {job.status}; only a batch in progress cancels",
            code="batch_not_cancellable",
        )
    try:
        job = jobs.cancel(caller, key)
    except Conflict as error:  # finished between the read and the lock
        raise InputError(str(error), code="batch_not_cancellable") from None
    except NotFound:
        raise BatchNotFound(batch_id(key)) from None
    if job.status in TERMINAL_JOB_STATUSES and make_files(jobs.engine, key):
        job = get_batch(jobs, caller, key)
    return job


def _unix(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def batch_view(job: Job) -> Batch:
    """The job as an OpenAI `Batch`. A finished batch whose output files are not made yet is
    `finalizing` (OpenAI's word for it)."""
    status = job.status.value if isinstance(job.status, JobStatus) else str(job.status)
    refused = job.batch_errors is not None
    finalizing = status in _ENDED and not refused and job.output_file_id is None
    ended: dict[str, int | None] = dict.fromkeys(_ENDED)
    if not finalizing and status in ended:
        ended[status] = _unix(job.finished_at)
    shown = "in_progress" if status in ("queued", "running") else status
    return Batch.model_validate(
        {
            "id": batch_id(job.id),
            "object": "batch",
            "endpoint": job.endpoint,
            "model": job.model,
            "errors": {"object": "list", "data": job.batch_errors} if refused else None,
            "input_file_id": files.file_id(job.input_file_id) if job.input_file_id else "",
            "completion_window": job.completion_window_text or "24h",
            "status": "finalizing" if finalizing else shown,
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
    )


# --- output files -----------------------------------------------------------------------------

# Batches a call of make_due_files takes at most: each is rendered once to size its files.
DUE_FILES_PER_CALL = 20


def make_due_files(engine: sa.Engine, limit: int = DUE_FILES_PER_CALL) -> int:
    """Make the output files of finished batches that have none yet; returns how many."""
    with reads(engine).connect() as conn:
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
    """Make a finished batch's output file (and, if any item did not succeed, its error file),
    once. The lines are rendered to size the files before the job's row is locked (the
    ledger's insert_outputs); only one process stores them."""
    with orm.Session(reads(engine)) as session:
        job = session.get(Job, job_id)
        if job is None or job.output_file_id is not None or job.endpoint is None:
            return False
        if job.status not in TERMINAL_JOB_STATUSES or job.batch_errors is not None:
            return False
        kinds = [FileKind.output]
        if job.failed + job.cancelled + job.expired > 0:
            kinds.append(FileKind.error)
    # Rendered after the session gave its connection back: the rows are read through another,
    # and one caller holding two of a pool's connections can wait on another doing the same.
    sizes = {kind: sum(len(chunk) for chunk in render(engine, job, kind)) for kind in kinds}
    with engine.begin() as conn:
        return ledger.insert_outputs(conn, job_id, sizes)


def render(engine: sa.Engine, job: Job, kind: FileKind, batch: int = 1000) -> Iterator[bytes]:
    """The lines of a batch's output (its succeeded items) or error file (the others)."""
    endpoint, model = job.endpoint or lines.CHAT, job.model
    buffer: list[bytes] = []
    for row in result_rows(engine, job.id, succeeded=kind == FileKind.output):
        buffer.append(lines.render(row, endpoint=endpoint, model=row.model or model))
        if len(buffer) >= batch:
            yield b"".join(buffer)
            buffer.clear()
    if buffer:
        yield b"".join(buffer)


def open_file(jobs: JobService, caller: Caller, key: uuid.UUID) -> tuple[int, Iterator[bytes]]:
    """A file's size and content: an upload's chunks, or a batch's rendered lines (whose size
    was measured when they were made). The file's ownership is checked here, before the first
    byte (FileNotFound otherwise)."""
    with jobs.read_sessions() as session:
        found = files.get_file(session, caller, key)
        job = session.get(Job, found.job_id) if found.job_id else None
        kind, size = found.kind, found.bytes
    if job is None:
        return size, files.iter_chunks(jobs.engine, key)
    return size, render(jobs.engine, job, FileKind(kind))


# --- models -----------------------------------------------------------------------------------


def served_models(session: orm.Session, settings: Settings) -> ModelList:
    """Every served name, as OpenAI's list: those the fleet is configured for (SERVED_MODELS)
    and those live workers serve (their base models and adapters, from their heartbeats),
    each with its live worker count; an adapter names its base model as `parent`. A name with
    no live worker is listed with 0: jobs for it are accepted and wait for one."""
    since = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, settings.worker_dead_after_s)
    rows = session.execute(
        sa.select(Worker.model, Worker.adapters, Worker.started_at).where(
            Worker.stopped_at.is_(None), Worker.heartbeat_at > since
        )
    ).all()
    workers: dict[str, int] = {}
    started: dict[str, datetime] = {}
    parent: dict[str, str] = {name: settings.model_name for name in settings.lora_adapters}
    for model, adapters, at in rows:
        for name in (model, *(adapters or ())):
            workers[name] = workers.get(name, 0) + 1
            started[name] = min(at, started.get(name, at))
        for name in adapters or ():
            parent[name] = model
    names = [*settings.configured_models]
    names += sorted(set(workers) - set(names))
    return ModelList.model_validate(
        {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": _unix(started.get(name)),
                 "owned_by": "thinkbatch", "parent": parent.get(name),
                 "workers": workers.get(name, 0)}
                for name in names
            ],
        }
    )  # fmt: skip
