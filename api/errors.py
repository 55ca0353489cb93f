"""One error envelope for every 4xx and 5xx: {"error": {"type", "code", "message", "param"}}.

Every request has an id (a sane incoming X-Request-ID, or a new one), returned in the
X-Request-ID header; a 500 states it in its message and its log line, so the two can be matched.
A log line never carries an exception's message: a database error's text holds the row it
failed on (a COPY error quotes the prompt), so only the exception's type, SQLSTATE and frames
are logged.
"""

from __future__ import annotations

import logging
import re
import traceback
import uuid

from flask import Flask
from flask import Response
from flask import g
from flask import jsonify
from flask import request
from sqlalchemy import exc as sa_exc
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import RequestEntityTooLarge

from api.auth import TooManyFailures
from api.auth import Unauthorized
from thinkbatch.db import is_transient
from thinkbatch.errors import ApiError
from thinkbatch.errors import Conflict
from thinkbatch.errors import InputError
from thinkbatch.errors import NotFound
from thinkbatch.jobs.quotas import QuotaExceeded

log = logging.getLogger(__name__)


def error_response(
    status: int, type_: str, code: str, message: str, param: str | None = None
) -> tuple[Response, int]:
    body = ApiError(error=ApiError.Body(type=type_, code=code, message=message, param=param))
    return jsonify(body.model_dump()), status


REQUEST_ID_HEADER = "X-Request-ID"
_SANE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id() -> str:
    rid: str | None = g.get("request_id")
    if rid is None:
        incoming = request.headers.get(REQUEST_ID_HEADER, "")
        rid = incoming if _SANE_REQUEST_ID.fullmatch(incoming) else uuid.uuid4().hex
        g.request_id = rid
    return rid


def _describe(error: BaseException) -> str:
    """The exception's type, SQLSTATE and stack, without its message or its causes' messages:
    those can quote the request's data."""
    parts: list[str] = []
    current: BaseException | None = error
    while current is not None and len(parts) < 5:
        name = f"{type(current).__module__}.{type(current).__qualname__}"
        state = getattr(getattr(current, "orig", current), "sqlstate", None)
        parts.append(f"{name} (SQLSTATE {state})" if state else name)
        current = current.__cause__ or current.__context__
    frames = "".join(traceback.format_list(traceback.extract_tb(error.__traceback__)))
    return " <- ".join(parts) + "\n" + frames.rstrip()


def _server_error(error: BaseException) -> tuple[Response, int]:
    rid = request_id()
    log.error("unhandled error [request %s]: %s", rid, _describe(error))
    return error_response(500, "server_error", "internal", f"internal error (request id {rid})")


def init_app(app: Flask) -> None:
    @app.before_request
    def assign_request_id() -> None:
        request_id()

    @app.after_request
    def return_request_id(response: Response) -> Response:
        response.headers[REQUEST_ID_HEADER] = request_id()
        return response

    @app.errorhandler(RequestEntityTooLarge)
    def too_large(error: RequestEntityTooLarge) -> tuple[Response, int]:
        limit = app.config.get("MAX_CONTENT_LENGTH")
        return error_response(
            413,
            "invalid_request_error",
            "request_entity_too_large",
            f"request body: larger than the limit of {limit} bytes (MAX_REQUEST_BYTES)",
        )

    @app.errorhandler(InputError)
    def invalid(error: InputError) -> tuple[Response, int]:
        return error_response(
            error.status, "invalid_request_error", error.code, error.message, error.param
        )

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
        # The id is echoed so a typo shows, but cut: a path can be kilobytes long.
        raw = error.ident
        shown = raw if len(raw) <= 64 else raw[:64] + "..."
        return error_response(
            404, "not_found", error.code, f"no {error.kind} {shown!r}", error.param
        )

    @app.errorhandler(Conflict)
    def conflict(error: Conflict) -> tuple[Response, int]:
        return error_response(409, "conflict", "job_finished", str(error))

    @app.errorhandler(HTTPException)
    def http_error(error: HTTPException) -> tuple[Response, int]:
        # Routing errors (unknown path, wrong method, wrong media type ...) in the same envelope.
        status = error.code or 500
        kind = {404: "not_found", 409: "conflict", 429: "rate_limit_error"}.get(
            status, "invalid_request_error"
        )
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
            log.warning(
                "database unavailable [request %s]: %s", request_id(), type(error.orig).__name__
            )
            return error_response(
                503, "unavailable", "database_unavailable", "the database is unavailable; retry"
            )
        return _server_error(error)

    @app.errorhandler(Exception)
    def unexpected(error: Exception) -> tuple[Response, int]:
        return _server_error(error)
