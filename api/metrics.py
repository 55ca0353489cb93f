"""Prometheus `/metrics` of the API, anonymous like the probes.

Under gunicorn the API is several processes; prometheus-client's multiprocess mode has each one
write its samples to files in PROMETHEUS_MULTIPROC_DIR, and a scrape of any process adds them
up (api/gunicorn.conf.py sets the directory up, wipes it at start and marks exited workers
dead). Without that variable (tests, `flask run`) the process's own registry is served.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

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
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from api.auth import public
from api.openapi import Doc
from api.openapi import describe
from api.services import services
from thinkbatch.jobs.fleet import live_workers
from thinkbatch.jobs.fleet import work_by_model

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
    fleet = CollectorRegistry()
    fleet.register(FleetCollector())
    text = generate_latest(registry()) + generate_latest(fleet)
    return Response(text, content_type=CONTENT_TYPE_LATEST)


class FleetCollector(Collector):
    """The work by model, read from Postgres at scrape time (the system of record, the same for
    every API process): pending and running items by model, and live workers by served name,
    0 for a configured model that none serves (its jobs wait: worth an alert)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        svc = services()
        settings = svc.settings
        with svc.jobs.reads.connect() as conn:
            work = work_by_model(conn)
            live = live_workers(conn, dead_after_s=settings.worker_dead_after_s)
        items = GaugeMetricFamily(
            "thinkbatch_items", "Pending and running items, by model and status.",
            labels=["model", "status"],
        )  # fmt: skip
        models = sorted({m for m, _ in work} | set(settings.configured_models) | set(live))
        for model in models:
            for status in ("pending", "running"):
                items.add_metric([model, status], work.get((model, status), 0))
        yield items
        workers = GaugeMetricFamily(
            "thinkbatch_model_live_workers",
            "Live workers serving each model (a base model or an adapter); 0: its jobs wait.",
            labels=["model"],
        )
        for model in models:
            workers.add_metric([model], live.get(model, 0))
        yield workers


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
