"""What every route needs, built once by the app factory (api/__init__.py `create_app`) and
kept on the app: the settings, the database, the Celery app and the job service's front door."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from typing import TypeVar

import sqlalchemy as sa
from celery import Celery
from flask import Flask
from flask import Response
from flask import current_app
from flask import g
from flask import request
from sqlalchemy import orm

from thinkbatch.jobs import JobService
from thinkbatch.settings import Settings


@dataclass(frozen=True)
class Services:
    settings: Settings
    engine: sa.Engine
    sessions: orm.sessionmaker[orm.Session]
    # Sessions for reads alone, each statement committed on its own (JobService.reads): a read
    # that ended in a rollback would drop the pooled connection's prepared statements, those
    # every status call runs.
    read_sessions: orm.sessionmaker[orm.Session]
    celery: Celery
    jobs: JobService  # the job service's front door: every route of jobs and batches uses it


F = TypeVar("F", bound=Callable[..., Any])


def reads_request_connection(view: F) -> F:
    """Mark a view that reads through `request_connection()` alone, the one the
    authentication took. Any other view gets it back before it runs (init_app): a view that
    took a connection of its own while the request held this one would hold two of the pool's
    connections at once, and as many requests as there are threads doing so would wait on each
    other for a pool that has fewer than twice as many, until the pool's timeout."""
    # A marker on the view function itself, read back before the view runs.
    view._thinkbatch_request_connection = True  # type: ignore[attr-defined]  # noqa: SLF001
    return view


def request_connection() -> sa.Connection:
    """This request's connection for reads (autocommit, JobService.reads), taken once and
    shared by the authentication and the view: one checkout (and its liveness check,
    thinkbatch.db.needs_ping) per request instead of one per query. Returned before the
    response is sent (init_app), and before the view runs unless the view is marked
    `reads_request_connection`."""
    conn: sa.Connection | None = g.get("thinkbatch_reads")
    if conn is None:
        conn = g.thinkbatch_reads = services().jobs.reads.connect()
    return conn


def release_connection() -> None:
    conn: sa.Connection | None = g.pop("thinkbatch_reads", None)
    if conn is not None:
        conn.close()


def init_app(app: Flask) -> None:
    @app.before_request
    def give_back_unless_the_view_reads_it() -> None:
        # Registered after the authentication's hook (api/__init__.py), so it runs after it.
        view = app.view_functions.get(request.endpoint or "")
        if not getattr(view, "_thinkbatch_request_connection", False):
            release_connection()

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
