"""What every route needs, built once by the app factory (api/__init__.py `create_app`) and
kept on the app: the settings, the database, the Celery app and the job service's front door."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from celery import Celery
from flask import current_app
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


def services() -> Services:
    services: Services = current_app.extensions["thinkbatch"]
    return services
