"""The REST API: `create_app(settings)` builds a Flask app over the shared job service."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from celery import Celery
from flask import Flask
from flask import current_app
from sqlalchemy import orm

from thinkbatch.db import make_engine
from thinkbatch.db import make_sessionmaker
from thinkbatch.queue import make_celery
from thinkbatch.settings import Settings


@dataclass(frozen=True)
class Services:
    settings: Settings
    engine: sa.Engine
    sessions: orm.sessionmaker[orm.Session]
    celery: Celery


def create_app(settings: Settings | None = None) -> Flask:
    settings = settings or Settings()
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_request_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]  # keep the documented field order
    engine = make_engine(settings)
    app.extensions["thinkbatch"] = Services(
        settings=settings,
        engine=engine,
        sessions=make_sessionmaker(engine),
        celery=make_celery(settings),
    )

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

    errors.init_app(app)
    # Before auth: a refused request is timed, counted and logged like any other.
    metrics.init_app(app)
    access_log.init_app(app)
    body.init_app(app)  # the intake's refusals: before auth, as a server would answer them
    auth.init_app(app)
    params.init_app(app)  # after auth: a stranger learns nothing of a route
    app.register_blueprint(health.bp)
    app.register_blueprint(jobs.bp)
    app.register_blueprint(openapi.bp)
    dashboard.init_app(app)
    app.register_blueprint(openai_files.bp)
    app.register_blueprint(openai_batches.bp)
    return app


def services() -> Services:
    services: Services = current_app.extensions["thinkbatch"]
    return services
