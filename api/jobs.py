"""/v1/jobs: submit, poll, page through items, stream results, cancel."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import stream_with_context

from api import params
from api import services
from api.body import require_json
from api.body import spool
from thinkbatch import jobs as service
from thinkbatch.queue import mark_hinted
from thinkbatch.queue import publish_job

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")


@bp.post("")
def create() -> tuple[dict[str, object], int]:
    svc = services()
    require_json()
    # The whole body first, off the network, with no transaction open (see api.body); then
    # parse and store it as it streams from the spool: any invalid item rolls everything back.
    with spool(svc.settings) as body, svc.sessions.begin() as session:
        job = service.create_job_from_stream(session, body, svc.settings)
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
        page = service.list_jobs(session, after=params.job_cursor(), limit=params.limit())
    return page.model_dump(mode="json")


@bp.get("/<job_id>")
def get(job_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        job = service.get_job(session, service.parse_job_id(job_id))
        return service.job_out(job).model_dump(mode="json")


@bp.get("/<job_id>/items")
def items(job_id: str) -> dict[str, object]:
    svc = services()
    status = service.parse_item_status(params.status())
    after, limit = params.item_cursor(), params.limit()
    with svc.sessions() as session:
        page = service.items_page(
            session, service.parse_job_id(job_id), status=status, after=after, limit=limit
        )
    return page.model_dump(mode="json")


@bp.get("/<job_id>/results")
def results(job_id: str) -> Response:
    svc = services()
    status = service.parse_item_status(params.status())
    key = service.parse_job_id(job_id)
    with svc.sessions() as session:
        service.get_job(session, key)  # 404 before the stream starts
    stream = service.iter_results(svc.engine, key, status=status)
    return Response(stream_with_context(stream), mimetype="application/x-ndjson")


@bp.post("/<job_id>/cancel")
def cancel(job_id: str) -> dict[str, object]:
    svc = services()
    require_json(body_required=False)
    with svc.sessions() as session:
        job = service.cancel_job(session, service.parse_job_id(job_id))
        return service.job_out(job).model_dump(mode="json")
