"""What every route needs, built once by the app factory (api/__init__.py `create_app`) and
kept on the app: the settings, the database, the Celery app and the job service's front door."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from celery import Celery
from flask import Flask
from flask import Response
from flask import current_app
from flask import g
from sqlalchemy import orm

from thinkbatch.jobs import JobService
from thinkbatch.settings import Settings


@dataclass(frozen=True)
class Services:
    settings: Settings
    engine: sa.Engine
    sessions: orm.sessionmaker[orm.Session]
    celery: Celery
    jobs: JobService  # the job service's front door: every route of jobs and batches uses it


def request_connection() -> sa.Connection:
    """This request's connection for reads (autocommit, JobService.reads), taken once and
    shared by the authentication and the view: one checkout (and one liveness ping) per
    request instead of one per query. Returned before the response is sent (init_app)."""
    conn: sa.Connection | None = g.get("thinkbatch_reads")
    if conn is None:
        conn = g.thinkbatch_reads = services().jobs.reads.connect()
    return conn


def release_connection() -> None:
    conn: sa.Connection | None = g.pop("thinkbatch_reads", None)
    if conn is not None:
        conn.close()


def init_app(app: Flask) -> None:
    @app.after_request
    def give_back(response: Response) -> Response:
        # Before a streamed body runs: a download must not hold the request's connection.
        release_connection()
        return response

    @app.teardown_request
    def give_back_on_error(_: BaseException | None) -> None:
        release_connection()


def services() -> Services:
    services: Services = current_app.extensions["thinkbatch"]
    return services
