"""/v1/batches and /v1/models: the OpenAI Batch API over the job service
(thinkbatch/openai/batches.py)."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import request
from pydantic import ValidationError

from api import params
from api.auth import caller
from api.body import IDEMPOTENCY
from api.body import idempotency_key
from api.body import no_fields
from api.body import replayed_header
from api.body import require_json
from api.body import spool
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from api.replies import json_reply
from api.services import services
from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import read_object
from thinkbatch.guard import validation_error
from thinkbatch.openai import batches as service
from thinkbatch.openai.wire import Batch
from thinkbatch.openai.wire import BatchCreate
from thinkbatch.openai.wire import BatchList
from thinkbatch.openai.wire import ModelList

bp = Blueprint("openai_batches", __name__)

BATCH_ID = {"batch_id": ({"type": "string", "pattern": "^batch_[0-9a-f]{32}$"}, "A batch id.")}
MAX_BODY = 64 * 1024  # a batch request is a few fields; its requests are in the file
MAX_LIST = 100


def _body() -> BatchCreate:
    svc = services()
    require_json()
    too_large = InputError(
        f"request body: larger than {MAX_BODY} bytes, more than a batch's create takes",
        code="request_entity_too_large",
        status=413,
    )
    if (request.content_length or 0) > MAX_BODY:
        raise too_large
    with spool(svc.settings) as body:
        raw = body.read(MAX_BODY + 1)
    if len(raw) > MAX_BODY:
        raise too_large
    # The same guarded reader as a job body: strict UTF-8, no NUL, lone surrogate or duplicate
    # key, bounded depth, and numbers in range (json.loads raises ValueError past 4,300 digits).
    data = read_object(raw, Limits.of(svc.settings, items_key=None))
    try:
        return BatchCreate.model_validate(data)
    except ValidationError as error:
        raise validation_error(error, data=data) from None


@bp.post("/v1/batches")
@describe(
    Doc(
        summary="Create a batch from an uploaded file (a job, in OpenAI's Batch shape).",
        body=BatchCreate,
        headers=(IDEMPOTENCY,),
        responses={200: Batch},
        notes={200: "The batch: `in_progress`, or `failed` with `errors` when lines are invalid."},
        errors=(400, 404, 408, 413, 415, 429),
        tags=("openai",),
    )
)
def create() -> Response:
    svc = services()
    key = idempotency_key()
    made = service.create_batch(svc.jobs, caller(), _body(), idempotency_key=key)
    return json_reply(service.batch_view(made.job), headers=replayed_header(made.replayed))


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
def list_() -> Response:
    svc = services()
    page = service.list_batches(
        svc.jobs, caller(), after=params.after(), limit=params.limit(20, MAX_LIST)
    )
    return json_reply(page)


@bp.get("/v1/batches/<batch_id>")
@describe(Doc(summary="A batch.", path=BATCH_ID, responses={200: Batch}, errors=(404,),
              tags=("openai",)))  # fmt: skip
def get(batch_id: str) -> Response:
    svc = services()
    job = service.get_batch(svc.jobs, caller(), service.parse_batch_id(batch_id))
    return json_reply(service.batch_view(job))


@bp.post("/v1/batches/<batch_id>/cancel")
@describe(
    Doc(
        summary="Cancel a batch in progress (no body, or {}). A finished batch is a 400.",
        path=BATCH_ID,
        responses={200: Batch},
        errors=(400, 404, 413, 415),
        tags=("openai",),
    )
)
def cancel(batch_id: str) -> Response:
    svc = services()
    no_fields(svc.settings)
    job = service.cancel_batch(svc.jobs, caller(), service.parse_batch_id(batch_id))
    return json_reply(service.batch_view(job))


@bp.get("/v1/models")
@describe(Doc(summary="The models live workers serve.", responses={200: ModelList},
              tags=("openai",)))  # fmt: skip
def models() -> Response:
    svc = services()
    with svc.read_sessions() as session:
        return json_reply(service.served_models(session, svc.settings))
