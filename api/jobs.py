"""/v1/jobs: submit, poll, page through items, stream results, cancel."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import stream_with_context

from api import metrics
from api import params
from api.auth import caller
from api.body import IDEMPOTENCY
from api.body import idempotency_key
from api.body import no_fields
from api.body import replayed_header
from api.body import require_json
from api.body import spool
from api.openapi import NDJSON
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from api.replies import json_reply
from api.services import reads_request_connection
from api.services import request_connection
from api.services import services
from thinkbatch.jobs import job_out
from thinkbatch.jobs import parse_item_status
from thinkbatch.jobs import parse_job_id
from thinkbatch.jobs import stats
from thinkbatch.jobs.wire import ItemPage
from thinkbatch.jobs.wire import JobCreate
from thinkbatch.jobs.wire import JobOut
from thinkbatch.jobs.wire import JobPage
from thinkbatch.models import ItemStatus

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")

LIMIT = Query(
    "limit",
    {"type": "integer", "minimum": 1, "maximum": params.MAX_PAGE, "default": params.DEFAULT_PAGE},
    "Page size, in plain ASCII digits.",
)
INCLUDE_THINKING = Query(
    "include_thinking",
    {"type": "string", "enum": ["true", "false"], "default": "true"},
    "`false` leaves the reasoning out: `thinking` is null in every record, and the database "
    "does not read it. For downloads of answers only.",
)
STATUS = Query(
    "status",
    {"type": "string", "enum": [s.value for s in ItemStatus]},
    "Only items in this status.",
)


@bp.post("")
@describe(
    Doc(
        summary="Submit a job.",
        body=JobCreate,
        headers=(IDEMPOTENCY,),
        responses={201: JobOut},
        notes={201: "The job, stored and queued (or, for a repeated Idempotency-Key, the job "
               "the first request made)."},
        errors=(400, 408, 413, 415, 429),
        tags=("jobs",),
    )
)  # fmt: skip
def create() -> Response:
    svc = services()
    require_json()
    key = idempotency_key()
    # The whole body has arrived (api/intake.py); it is parsed and stored as it streams from
    # the spool, in one transaction: any invalid item stores nothing.
    with spool(svc.settings) as body:
        made = svc.jobs.submit_stream(caller(), body, idempotency_key=key)
    out = job_out(made.job, stats.empty(), svc.jobs.waiting_for(made.job))
    if not made.replayed:
        metrics.job_submitted(out.counts.total)
    return json_reply(out, 201, replayed_header(made.replayed))


@bp.get("")
@describe(
    Doc(
        summary="List jobs, newest first.",
        query=(
            Query("after", {"type": "string", "format": "uuid"}, "The last job id of the page "
                  "before (its `last_id`)."),
            LIMIT,
        ),
        responses={200: JobPage},
        errors=(400,),
        tags=("jobs",),
    )
)  # fmt: skip
def list_() -> Response:
    svc = services()
    page = svc.jobs.page(caller(), after=params.job_cursor(), limit=params.limit())
    return json_reply(page)


@bp.get("/<job_id>")
@describe(
    Doc(
        summary="A job, with its thinking statistics (`stats`).",
        responses={200: JobOut},
        notes={200: "The job; `stats` is computed from its results as they are now."},
        errors=(404,),
        tags=("jobs",),
    )
)
@reads_request_connection
def get(job_id: str) -> Response:
    svc = services()
    job = svc.jobs.status(caller(), parse_job_id(job_id), request_connection())
    return json_reply(job)


@bp.get("/<job_id>/items")
@describe(
    Doc(
        summary="A page of the job's item records, in submission order.",
        query=(
            STATUS,
            Query("after", {"type": "string"}, "The last custom_id of the page before."),
            LIMIT,
            INCLUDE_THINKING,
        ),
        responses={200: ItemPage},
        errors=(400, 404),
        tags=("jobs",),
    )
)
@reads_request_connection
def items(job_id: str) -> Response:
    svc = services()
    page = svc.jobs.items(
        caller(),
        parse_job_id(job_id),
        status=parse_item_status(params.status()),
        after=params.after(),
        limit=params.limit(),
        include_thinking=params.include_thinking(),
        conn=request_connection(),
    )
    return json_reply(page)


@bp.get("/<job_id>/results")
@describe(
    Doc(
        summary="Every item record of the job, one JSON object (ItemOut) per line.",
        query=(STATUS, INCLUDE_THINKING),
        responses={200: NDJSON},
        notes={200: "NDJSON: one `ItemOut` object per line, in submission order."},
        errors=(400, 404),
        tags=("jobs",),
    )
)
@reads_request_connection
def results(job_id: str) -> Response:
    svc = services()
    stream = svc.jobs.results(  # 404 before it starts
        caller(),
        parse_job_id(job_id),
        status=parse_item_status(params.status()),
        include_thinking=params.include_thinking(),
        # Given back before the body streams (api/services.py): the download reads on one
        # connection of its own.
        conn=request_connection(),
    )
    return Response(stream_with_context(stream), mimetype="application/x-ndjson")


@bp.post("/<job_id>/cancel")
@describe(
    Doc(
        summary="Cancel a queued or running job (no body, or {}).",
        responses={200: JobOut},
        errors=(400, 404, 409, 413, 415),
        tags=("jobs",),
    )
)
def cancel(job_id: str) -> Response:
    svc = services()
    no_fields(svc.settings)
    key = parse_job_id(job_id)
    svc.jobs.cancel(caller(), key)
    return json_reply(svc.jobs.status(caller(), key))
