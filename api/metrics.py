"""Prometheus `/metrics` of the API, anonymous like the probes.

Under gunicorn the API is several processes; prometheus-client's multiprocess mode has each one
write its samples to files in PROMETHEUS_MULTIPROC_DIR, and a scrape of any process adds them
up (api/gunicorn.conf.py sets the directory up, wipes it at start and marks exited workers
dead). Without that variable (tests, `flask run`) the process's own registry is served.
"""

from __future__ import annotations

import os
import time

from flask import Blueprint
from flask import Flask
from flask import Response
from flask import g
from flask import request
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client import REGISTRY
from prometheus_client import CollectorRegistry
from prometheus_client import Counter
from prometheus_client import Histogram
from prometheus_client import generate_latest
from prometheus_client import multiprocess

from api.auth import public
from api.openapi import Doc
from api.openapi import describe

bp = Blueprint("metrics", __name__)

REQUESTS = Counter(
    "thinkbatch_api_requests",
    "HTTP requests answered, by route template, method and status.",
    ["route", "method", "status"],
)
DURATION = Histogram(
    "thinkbatch_api_request_duration_seconds",
    "Time to answer a request (a streamed download counts until its first byte).",
    ["route", "method"],
)
JOBS = Counter("thinkbatch_api_jobs_submitted", "Jobs accepted (stored and queued).")
ITEMS = Counter("thinkbatch_api_items_submitted", "Items of the jobs accepted.")
UNMATCHED = "<unmatched>"  # every unknown URL counts under one label, not one label per URL


def job_submitted(items: int) -> None:
    JOBS.inc()
    ITEMS.inc(items)


def registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)  # type: ignore[no-untyped-call]
        return merged
    return REGISTRY


@bp.get("/metrics")
@public
@describe(
    Doc(
        summary="Prometheus metrics of the API (text exposition format).",
        responses={200: "text/plain"},
        tags=("meta",),
    )
)
def metrics() -> Response:
    return Response(generate_latest(registry()), content_type=CONTENT_TYPE_LATEST)


def init_app(app: Flask) -> None:
    @app.before_request
    def start_timer() -> None:
        g.thinkbatch_started = time.perf_counter()

    @app.after_request
    def count(response: Response) -> Response:
        route = request.url_rule.rule if request.url_rule is not None else UNMATCHED
        REQUESTS.labels(route, request.method, str(response.status_code)).inc()
        started = g.get("thinkbatch_started")
        if started is not None:
            DURATION.labels(route, request.method).observe(time.perf_counter() - started)
        return response

    app.register_blueprint(bp)
