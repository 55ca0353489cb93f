"""The REST API: `create_app(settings)` builds a Flask app over the shared job service."""

from __future__ import annotations

from flask import Flask

from api import access_log
from api import auth
from api import body
from api import dashboard
from api import errors
from api import health
from api import jobs
from api import metrics
from api import openai_batches
from api import openai_files
from api import openapi
from api import params
from api import services
from api.services import Services
from thinkbatch.db import make_engine
from thinkbatch.jobs import JobService
from thinkbatch.queue import make_celery
from thinkbatch.settings import Settings


def create_app(settings: Settings) -> Flask:
    """The app over the settings its process built once (api/asgi.py; tests pass their own)."""
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the documented field order
    # A connection for each request thread, so that none waits on the pool for its first;
    # and DB_POOL_SIZE more at a peak for the one request that reads through a second while
    # it holds its first: a batch's create, which reads its input file while its items are
    # copied in (tests/api/test_connections.py). Every thread holding its first, a second is
    # still there for one of them, which ends and gives both back.
    threads = max(settings.api_threads + settings.api_bulk_threads, settings.db_pool_size)
    engine = make_engine(settings, pool_size=threads, max_overflow=settings.db_pool_size)
    celery = make_celery(settings)
    front_door = JobService(settings, engine, celery)
    app.extensions["thinkbatch"] = Services(
        settings=settings,
        engine=engine,
        sessions=front_door.sessions,
        read_sessions=front_door.read_sessions,
        celery=celery,
        jobs=front_door,
    )

    errors.init_app(app)
    # Before auth: a refused request is timed, counted and logged like any other.
    metrics.init_app(app)
    access_log.init_app(app)
    body.init_app(app)  # the intake's refusals: before auth, as a server would answer them
    auth.init_app(app)
    services.init_app(app)  # after auth: what the authentication read with is given back
    params.init_app(app)  # after auth: a stranger learns nothing of a route
    app.register_blueprint(health.bp)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(openapi.bp)
    dashboard.init_app(app)
    app.register_blueprint(openai_files.bp)
    app.register_blueprint(openai_batches.bp)
    return app
