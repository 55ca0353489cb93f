"""/v1/jobs: submit, poll, page through items, stream results, cancel."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import request
from flask import stream_with_context

from api import services
from api.auth import caller
from thinkbatch import jobs as service
from thinkbatch.jobs import InvalidRequest
from thinkbatch.queue import mark_hinted
from thinkbatch.queue import publish_job

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")

DEFAULT_PAGE = 100
MAX_PAGE = 1000


def _limit() -> int:
    raw = request.args.get("limit")
    if raw is None:
        return DEFAULT_PAGE
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest("limit: must be an integer", param="limit") from None
    if not 1 <= value <= MAX_PAGE:
        raise InvalidRequest(f"limit: must be between 1 and {MAX_PAGE}", param="limit")
    return value


@bp.post("")
def create() -> tuple[dict[str, object], int]:
    svc = services()
    with svc.sessions.begin() as session:
        # Read and store the body as it streams; any invalid item rolls everything back.
        job = service.create_job_from_stream(session, caller(), request.stream, svc.settings)
        out = service.job_out(job)
        copies = service.fanout(job, svc.settings)
    # After the commit: a worker must find the rows. If Redis is down the job still stands;
    # the sweeper enqueues it once Redis is back.
    if publish_job(svc.celery, job.id, copies=copies):
        with svc.engine.begin() as conn:
            mark_hinted(conn, job.id)
    return out.model_dump(mode="json"), 201


@bp.get("")
def list_() -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        page = service.list_jobs(session, caller(), after=request.args.get("after"), limit=_limit())
    return page.model_dump(mode="json")


@bp.get("/<job_id>")
def get(job_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        job = service.get_job(session, caller(), service.parse_job_id(job_id))
        return service.job_out(job).model_dump(mode="json")


@bp.get("/<job_id>/items")
def items(job_id: str) -> dict[str, object]:
    svc = services()
    status = service.parse_item_status(request.args.get("status"))
    with svc.sessions() as session:
        page = service.items_page(
            session,
            caller(),
            service.parse_job_id(job_id),
            status=status,
            after=request.args.get("after"),
            limit=_limit(),
        )
    return page.model_dump(mode="json")


@bp.get("/<job_id>/results")
def results(job_id: str) -> Response:
    svc = services()
    status = service.parse_item_status(request.args.get("status"))
    key = service.parse_job_id(job_id)
    stream = service.iter_results(svc.engine, caller(), key, status=status)  # 404 before it starts
    return Response(stream_with_context(stream), mimetype="application/x-ndjson")


@bp.post("/<job_id>/cancel")
def cancel(job_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        job = service.cancel_job(session, caller(), service.parse_job_id(job_id))
        return service.job_out(job).model_dump(mode="json")
