"""/v1/batches and /v1/models: the OpenAI Batch API over jobs (thinkbatch/batches.py)."""

from __future__ import annotations

import re

from flask import Blueprint
from flask import Response
from flask import request
from pydantic import ValidationError
from werkzeug.exceptions import RequestEntityTooLarge

from api import params
from api import services
from api.auth import caller
from api.body import require_json
from api.body import spool
from api.errors import error_response
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from thinkbatch import batches as service
from thinkbatch import files
from thinkbatch import job_create
from thinkbatch.ingest import BodyError
from thinkbatch.ingest import Limits
from thinkbatch.ingest import read_object
from thinkbatch.ingest import validation_error
from thinkbatch.jobs import InvalidRequest
from thinkbatch.ledger import mark_hinted
from thinkbatch.models import TERMINAL_JOB_STATUSES
from thinkbatch.models import JobStatus
from thinkbatch.openai_schemas import Batch
from thinkbatch.openai_schemas import BatchList
from thinkbatch.openai_schemas import ModelList
from thinkbatch.queue import publish_job

bp = Blueprint("openai_batches", __name__)

BATCH_ID = {"batch_id": ({"type": "string", "pattern": "^batch_[0-9a-f]{32}$"}, "A batch id.")}
MAX_BODY = 64 * 1024  # a batch request is a few fields; its requests are in the file
MAX_LIST = 100
_DIGITS = re.compile(r"[0-9]{1,9}")
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
IDEMPOTENCY = Query(
    "Idempotency-Key",
    {"type": "string", "pattern": "^[\\x21-\\x7e]{1,255}$"},
    "Repeating a create with the same key answers the batch the first one made.",
)


@bp.errorhandler(service.BatchNotFound)
def _batch_not_found(error: service.BatchNotFound) -> tuple[Response, int]:
    return error_response(404, "not_found", "batch_not_found", f"no batch {error.args[0]!r}")


@bp.errorhandler(files.FileNotFound)
def _file_not_found(error: files.FileNotFound) -> tuple[Response, int]:
    return error_response(
        404, "not_found", "file_not_found", f"no file {error.args[0]!r}", "input_file_id"
    )


def _body() -> service.BatchCreate:
    svc = services()
    require_json()
    if (request.content_length or 0) > MAX_BODY:
        raise RequestEntityTooLarge()
    with spool(svc.settings) as body:
        raw = body.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise RequestEntityTooLarge()
    # The same guarded reader as a job body: strict UTF-8, no NUL, lone surrogate or duplicate
    # key, bounded depth, and numbers in range (json.loads raises ValueError past 4,300 digits).
    try:
        data = read_object(raw, Limits.of(svc.settings, items_key=None))
    except BodyError as error:
        raise InvalidRequest(error.message, param=error.param, code=error.code) from None
    try:
        return service.BatchCreate.model_validate(data)
    except ValidationError as error:
        bad = validation_error(error)
        raise InvalidRequest(bad.message, param=bad.param, code=bad.code) from None


def _idempotency_key() -> str | None:
    values = request.headers.getlist("Idempotency-Key")
    if not values:
        return None
    if len(values) > 1 or not _KEY.fullmatch(values[0]):
        raise InvalidRequest(
            "Idempotency-Key: one value of 1 to 255 printable ASCII characters",
            param="Idempotency-Key",
        )
    return values[0]


@bp.post("/v1/batches")
@describe(
    Doc(
        summary="Create a batch from an uploaded file (a job, in OpenAI's Batch shape).",
        body=service.BatchCreate,
        headers=(IDEMPOTENCY,),
        responses={200: Batch},
        notes={200: "The batch: `in_progress`, or `failed` with `errors` when lines are invalid."},
        errors=(400, 404, 408, 413, 415),
        tags=("openai",),
    )
)
def create() -> dict[str, object]:
    svc = services()
    key = _idempotency_key()
    spec = _body()
    with svc.sessions() as session:
        with session.begin():
            job, new = service.create_batch(
                session, svc.engine, caller(), spec, idempotency_key=key, settings=svc.settings
            )
            queued = new and job.status == JobStatus.queued
            copies = job_create.fanout(job, svc.settings)
        # After the commit, as for /v1/jobs: the sweeper enqueues it if Redis is down.
        if queued and publish_job(svc.celery, job.id, copies=copies):
            with svc.engine.begin() as conn:
                mark_hinted(conn, job.id)
        return service.batch_out(job)


def _limit() -> int:
    raw = params.single("limit")
    if raw is None:
        return 20
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIST:
        raise InvalidRequest(f"limit: must be an integer from 1 to {MAX_LIST}", param="limit")
    return int(raw)


@bp.get("/v1/batches")
@describe(
    Doc(
        summary="List batches, newest first.",
        query=(
            Query("after", {"type": "string"}, "The last batch id of the page before."),
            Query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST, "default": 20},
                  "Page size."),
        ),
        responses={200: BatchList},
        errors=(400,),
        tags=("openai",),
    )
)  # fmt: skip
def list_() -> dict[str, object]:
    svc = services()
    after, limit = params.single("after") or None, _limit()
    with svc.sessions() as session:
        return service.list_batches(session, caller(), after=after, limit=limit)


@bp.get("/v1/batches/<batch_id>")
@describe(Doc(summary="A batch.", path=BATCH_ID, responses={200: Batch}, errors=(404,),
              tags=("openai",)))  # fmt: skip
def get(batch_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        job = service.get_batch(session, caller(), service.parse_batch_id(batch_id))
        return service.batch_out(job)


@bp.post("/v1/batches/<batch_id>/cancel")
@describe(
    Doc(
        summary="Cancel a batch in progress (no body). A finished batch is a 400.",
        path=BATCH_ID,
        responses={200: Batch},
        errors=(400, 404, 415),
        tags=("openai",),
    )
)
def cancel(batch_id: str) -> dict[str, object]:
    svc = services()
    require_json(body_required=False)
    with svc.sessions() as session:
        job = service.cancel_batch(session, caller(), service.parse_batch_id(batch_id))
        if job.status in TERMINAL_JOB_STATUSES and service.make_files(svc.engine, job.id):
            session.refresh(job)  # a batch with nothing running ends at once: its files too
        return service.batch_out(job)


@bp.get("/v1/models")
@describe(Doc(summary="The models live workers serve.", responses={200: ModelList},
              tags=("openai",)))  # fmt: skip
def models() -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        return service.served_models(session, svc.settings)
