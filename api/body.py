"""Request bodies inside the app: the media type is checked, and the body is taken whole.

Under the server (api/asgi.py) the body has already been received in full, under its deadline,
by api.intake: `spool()` hands that spool on, and a refusal the intake made is raised before
any other part of the app runs. A WSGI caller without the intake (Flask's test client) has its
body copied into a spool here, bounded by MAX_REQUEST_BYTES.
"""

from __future__ import annotations

import re
import tempfile
from typing import IO
from typing import cast

from flask import Flask
from flask import request
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.exceptions import UnsupportedMediaType

from api.intake import BODY
from api.intake import REFUSAL
from api.intake import Refusal
from api.openapi import Query
from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.guard import is_blank
from thinkbatch.guard import read_object
from thinkbatch.settings import Settings

CHUNK = 64 * 1024
JSON = "application/json"
_UTF8 = ("utf-8", "utf8")
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
IDEMPOTENCY = Query(
    "Idempotency-Key",
    {"type": "string", "pattern": "^[\\x21-\\x7e]{1,255}$"},
    "Repeating a submission with the same key answers what the first one made (the same "
    "request) or a 400 (another request); a client that retries after a timeout never makes "
    "a second one.",
)
REPLAYED = "Idempotent-Replayed"


def idempotency_key() -> str | None:
    """The request's Idempotency-Key: one value of 1 to 255 printable ASCII characters."""
    values = request.headers.getlist("Idempotency-Key")
    if not values:
        return None
    if len(values) > 1 or not _KEY.fullmatch(values[0]):
        raise InputError(
            "Idempotency-Key: one value of 1 to 255 printable ASCII characters",
            param="Idempotency-Key",
        )
    return values[0]


def replayed_header(replayed: bool) -> dict[str, str]:
    """Says whether the answer is what an earlier request with the same key made."""
    return {REPLAYED: "true" if replayed else "false"}


def require_json(*, body_required: bool = True) -> None:
    """415 unless the body is declared `application/json` (charset, if given, UTF-8).

    Browsers send `text/plain` and form bodies cross-origin without a preflight; refusing them
    keeps a web page from submitting jobs to a local API on its visitor's behalf. A route whose
    body is optional (cancel) accepts a request with no body and no Content-Type.
    """
    if not body_required and not _has_body() and not request.content_type:
        return
    charset = request.mimetype_params.get("charset", "utf-8").lower()
    if request.mimetype != JSON or charset not in _UTF8:
        raise UnsupportedMediaType(
            "the body must be JSON: send Content-Type: application/json (charset utf-8)"
        )


def _has_body() -> bool:
    return (
        bool(request.content_length)
        or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    )


# The most a body of no fields may take: `{}` and whitespace, with room to spare.
NO_FIELDS_MAX = 1024


def no_fields(settings: Settings) -> None:
    """The body of a request that takes no fields (a cancel): none, empty, or a JSON object
    with no field. Anything else is a 400 naming what is wrong with it, rather than ignored: a
    client sending `{"custom_ids": [...]}` believes it asks for less than the whole job."""
    require_json(body_required=False)
    if not _has_body():
        return
    with spool(settings) as body:
        raw = body.read(NO_FIELDS_MAX + 1)
    if len(raw) > NO_FIELDS_MAX:
        raise InputError(
            f"request body: this request takes no fields; send none or {{}}, "
            f"not {NO_FIELDS_MAX} bytes or more",
            code="request_entity_too_large",
            status=413,
        )
    if is_blank(raw):
        return
    data = read_object(raw, Limits.of(settings, items_key=None))
    if data:
        name = next(iter(data))
        raise InputError(
            f"{name}: unknown field: this request takes no fields (send none or {{}})",
            param=name,
            code="unknown_field",
        )


def spool(settings: Settings) -> IO[bytes]:
    """The whole request body, rewound for reading."""
    scope = request.environ.get("asgi.scope")
    if scope is not None and BODY in scope:
        # The intake's spool: closing it here, once read, is as good as the intake's close.
        body = cast(IO[bytes], scope.pop(BODY))
        body.seek(0)
        return body
    out = tempfile.SpooledTemporaryFile(max_size=settings.spool_memory_bytes)  # noqa: SIM115
    try:
        stream = request.stream  # werkzeug raises 413 here when Content-Length is over the limit
        total = 0
        while chunk := stream.read(CHUNK):
            total += len(chunk)
            if total > settings.max_request_bytes:
                raise RequestEntityTooLarge()
            out.write(chunk)
    except BaseException:
        out.close()
        raise
    out.seek(0)
    return out


class Refused(HTTPException):
    """A request the intake did not take (api.intake.Refusal), answered in the envelope. The
    connection is closed after it: the client may still be sending the body it was refused."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.code = refusal.status
        self.refusal = refusal

    @property
    def name(self) -> str:
        return self.refusal.code.replace("_", " ")

    def get_headers(self, *args: object, **kwargs: object) -> list[tuple[str, str]]:
        headers = [("Connection", "close")]
        if self.refusal.retry_after is not None:
            headers.append(("Retry-After", str(self.refusal.retry_after)))
        return headers


def init_app(app: Flask) -> None:
    @app.before_request
    def raise_refusal() -> None:
        scope = request.environ.get("asgi.scope")
        refusal = scope.get(REFUSAL) if scope is not None else None
        if refusal is not None:
            raise Refused(refusal)
