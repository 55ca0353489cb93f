"""/v1/jobs: submit, poll, page through items, stream results, cancel."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import stream_with_context

from api import metrics
from api import params
from api import services
from api.auth import caller
from api.body import require_json
from api.body import spool
from api.openapi import NDJSON
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from thinkbatch import batches
from thinkbatch import job_create
from thinkbatch import jobs as service
from thinkbatch import stats
from thinkbatch.ledger import mark_hinted
from thinkbatch.models import TERMINAL_JOB_STATUSES
from thinkbatch.models import ItemStatus
from thinkbatch.queue import publish_job
from thinkbatch.schemas import ItemPage
from thinkbatch.schemas import JobCreate
from thinkbatch.schemas import JobOut
from thinkbatch.schemas import JobPage

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
        responses={201: JobOut},
        notes={201: "The job, stored and queued."},
        errors=(400, 408, 413, 415),
        tags=("jobs",),
    )
)
def create() -> tuple[dict[str, object], int]:
    svc = services()
    require_json()
    # The whole body first, off the network, with no transaction open (see api.body); then
    # parse and store it as it streams from the spool: any invalid item rolls everything back.
    with spool(svc.settings) as body, svc.sessions.begin() as session:
        job = job_create.create_job_from_stream(session, caller(), body, svc.settings)
        out = service.job_out(job, stats.empty())
        copies = job_create.fanout(job, svc.settings)
    metrics.job_submitted(out.counts.total)
    # After the commit: a worker must find the rows. If Redis is down the job still stands;
    # the sweeper enqueues it once Redis is back.
    if publish_job(svc.celery, job.id, copies=copies):
        with svc.engine.begin() as conn:
            mark_hinted(conn, job.id)
    return out.model_dump(mode="json"), 201


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
def list_() -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        page = service.list_jobs(session, caller(), after=params.job_cursor(), limit=params.limit())
    return page.model_dump(mode="json")


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
def get(job_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        out = service.job_with_stats(session, caller(), service.parse_job_id(job_id))
    return out.model_dump(mode="json")


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
def items(job_id: str) -> dict[str, object]:
    svc = services()
    status = service.parse_item_status(params.status())
    after, limit = params.item_cursor(), params.limit()
    include_thinking = params.include_thinking()
    with svc.sessions() as session:
        page = service.items_page(
            session,
            caller(),
            service.parse_job_id(job_id),
            status=status,
            after=after,
            limit=limit,
            include_thinking=include_thinking,
        )
    return page.model_dump(mode="json")


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
def results(job_id: str) -> Response:
    svc = services()
    status = service.parse_item_status(params.status())
    include_thinking = params.include_thinking()
    key = service.parse_job_id(job_id)
    stream = service.iter_results(  # 404 before it starts
        svc.engine, caller(), key, status=status, include_thinking=include_thinking
    )
    return Response(stream_with_context(stream), mimetype="application/x-ndjson")


@bp.post("/<job_id>/cancel")
@describe(
    Doc(
        summary="Cancel a queued or running job (no body).",
        responses={200: JobOut},
        errors=(404, 409, 415),
        tags=("jobs",),
    )
)
def cancel(job_id: str) -> dict[str, object]:
    svc = services()
    require_json(body_required=False)
    with svc.sessions() as session:
        job = service.cancel_job(session, caller(), service.parse_job_id(job_id))
        if job.endpoint is not None and job.status in TERMINAL_JOB_STATUSES:
            batches.make_files(svc.engine, job.id)  # a batch that ended at once: its files too
        return service.job_out(job, stats.job_stats(session, job)).model_dump(mode="json")
