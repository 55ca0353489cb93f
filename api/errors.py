"""One error envelope for every 4xx and 5xx: {"error": {"type", "code", "message", "param"}}."""

from __future__ import annotations

import logging

from flask import Flask
from flask import Response
from flask import jsonify
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException

from api.auth import TooManyFailures
from api.auth import Unauthorized
from thinkbatch.db import is_transient
from thinkbatch.jobs import Conflict
from thinkbatch.jobs import InvalidRequest
from thinkbatch.jobs import NotFound
from thinkbatch.quotas import QuotaExceeded
from thinkbatch.schemas import ApiError

log = logging.getLogger(__name__)


def error_response(
    status: int, type_: str, code: str, message: str, param: str | None = None
) -> tuple[Response, int]:
    body = ApiError(error=ApiError.Body(type=type_, code=code, message=message, param=param))
    return jsonify(body.model_dump()), status


def init_app(app: Flask) -> None:
    @app.errorhandler(InvalidRequest)
    def invalid(error: InvalidRequest) -> tuple[Response, int]:
        return error_response(400, "invalid_request_error", error.code, error.message, error.param)

    @app.errorhandler(Unauthorized)
    def unauthorized(error: Unauthorized) -> tuple[Response, int]:
        response, status = error_response(401, "authentication_error", error.code, error.message)
        response.headers["WWW-Authenticate"] = 'Bearer realm="thinkbatch"'
        return response, 401

    @app.errorhandler(TooManyFailures)
    def too_many_failures(error: TooManyFailures) -> tuple[Response, int]:
        response, status = error_response(
            429, "rate_limit_error", "too_many_auth_failures", str(error)
        )
        response.headers["Retry-After"] = str(error.retry_after)
        return response, status

    @app.errorhandler(QuotaExceeded)
    def quota_exceeded(error: QuotaExceeded) -> tuple[Response, int]:
        response, status = error_response(429, "rate_limit_error", error.code, error.message)
        response.headers["Retry-After"] = str(error.retry_after)
        return response, status

    @app.errorhandler(NotFound)
    def not_found(error: NotFound) -> tuple[Response, int]:
        return error_response(404, "not_found", "job_not_found", f"no job {error.args[0]!r}")

    @app.errorhandler(Conflict)
    def conflict(error: Conflict) -> tuple[Response, int]:
        return error_response(409, "conflict", "job_finished", str(error))

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> tuple[Response, int]:
        # Routing errors (unknown path, wrong method, wrong media type ...) in the same envelope.
        status = error.code or 500
        kind = {404: "not_found", 409: "conflict"}.get(status, "invalid_request_error")
        code = (error.name or "error").lower().replace(" ", "_")
        response, status = error_response(status, kind, code, error.description or error.name)
        # Keep what the exception says in headers: `Allow` on a 405 (RFC 9110 requires it),
        # `Connection: close` on a stalled upload's 408. Our body sets its own Content-Type.
        for name, value in error.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return response, status

    @app.errorhandler(sa_exc.DBAPIError)
    def database_error(error: sa_exc.DBAPIError) -> tuple[Response, int]:
        if is_transient(error):
            log.warning("database unavailable: %s", error.orig)
            return error_response(
                503, "unavailable", "database_unavailable", "the database is unavailable; retry"
            )
        log.exception("database error")
        return error_response(500, "server_error", "internal", "internal error")

    @app.errorhandler(Exception)
    def unexpected(error: Exception) -> tuple[Response, int]:
        log.exception("unhandled error")
        return error_response(500, "server_error", "internal", "internal error")
