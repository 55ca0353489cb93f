"""Liveness and readiness probes."""

from __future__ import annotations

import sqlalchemy as sa
from flask import Blueprint

from api import services
from api.auth import public

bp = Blueprint("health", __name__)


@bp.get("/healthz")
@public
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@bp.get("/readyz")
@public
def readyz() -> tuple[dict[str, object], int]:
    checks: dict[str, str] = {}
    try:
        with services().engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as error:  # noqa: BLE001 - report, do not raise
        checks["database"] = f"error: {type(error).__name__}"
    try:
        with services().celery.connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
        checks["redis"] = "ok"
    except Exception as error:  # noqa: BLE001
        checks["redis"] = f"error: {type(error).__name__}"
    ok = all(v == "ok" for v in checks.values())
    return {"status": "ok" if ok else "degraded", "checks": checks}, 200 if ok else 503
