"""/v1/batches and /v1/models: the OpenAI Batch API over jobs (thinkbatch/batches.py)."""

from __future__ import annotations

import json
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
from thinkbatch.ingest import validation_error
from thinkbatch.jobs import InvalidRequest
from thinkbatch.ledger import mark_hinted
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


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise InvalidRequest(f"{key}: given twice in the body", param=key)
        out[key] = value
    return out


def _body() -> service.BatchCreate:
    svc = services()
    require_json()
    if (request.content_length or 0) > MAX_BODY:
        raise RequestEntityTooLarge()
    with spool(svc.settings) as body:
        raw = body.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise RequestEntityTooLarge()
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise InvalidRequest(
            "body: not a JSON object (strict UTF-8)", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("body: must be a JSON object", code="invalid_json")
    _storable(data, "")
    try:
        return service.BatchCreate.model_validate(data)
    except ValidationError as error:
        bad = validation_error(error)
        raise InvalidRequest(bad.message, param=bad.param, code=bad.code) from None


def _storable(value: object, path: str) -> None:
    """Every string of the body, keys included, as PostgreSQL text and jsonb can hold it: no
    NUL, and no lone UTF-16 surrogate (json.loads turns a `\\ud800` escape into one)."""
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            _storable(key, path or "body")
            _storable(item, where)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _storable(item, f"{path}[{index}]")
    elif isinstance(value, str):
        if "\x00" in value:
            raise InvalidRequest(f"{path}: must not contain NUL (\\u0000)", param=path)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest(
                f"{path}: holds a lone UTF-16 surrogate, not a character", param=path
            ) from None


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
        return service.batch_out(session, svc.engine, job)


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
        return service.list_batches(session, svc.engine, caller(), after=after, limit=limit)


@bp.get("/v1/batches/<batch_id>")
@describe(Doc(summary="A batch.", path=BATCH_ID, responses={200: Batch}, errors=(404,),
              tags=("openai",)))  # fmt: skip
def get(batch_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        job = service.get_batch(session, caller(), service.parse_batch_id(batch_id))
        return service.batch_out(session, svc.engine, job)


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
        return service.batch_out(session, svc.engine, job)


@bp.get("/v1/models")
@describe(Doc(summary="The models live workers serve.", responses={200: ModelList},
              tags=("openai",)))  # fmt: skip
def models() -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        return service.served_models(session, svc.settings)
