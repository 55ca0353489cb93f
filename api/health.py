"""Liveness and readiness probes."""

from __future__ import annotations

from typing import Literal

import sqlalchemy as sa
from flask import Blueprint
from pydantic import BaseModel

from api.auth import public
from api.openapi import Doc
from api.openapi import describe
from api.services import services

bp = Blueprint("health", __name__)


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ok", "degraded"]
    checks: dict[str, str]


@bp.get("/healthz")
@public
@describe(Doc(summary="Liveness: the process answers.", responses={200: Health}, tags=("meta",)))
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@bp.get("/readyz")
@public
@describe(
    Doc(
        summary="Readiness: the database and Redis answer.",
        responses={200: Readiness, 503: Readiness},
        notes={503: "A dependency is down; `checks` says which."},
        tags=("meta",),
    )
)
def readyz() -> tuple[dict[str, object], int]:
    checks: dict[str, str] = {}
    try:
        with services().jobs.reads.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as error:  # noqa: BLE001 - report, do not raise
        checks["database"] = f"error: {type(error).__name__}"
    try:
        with services().celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
        checks["redis"] = "ok"
    except Exception as error:  # noqa: BLE001 - report, do not raise
        checks["redis"] = f"error: {type(error).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return {"status": "ok" if ok else "degraded", "checks": checks}, 200 if ok else 503
