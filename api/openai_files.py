"""/v1/files: the OpenAI Files API (uploads for batches, and batches' output files)."""

from __future__ import annotations

import re
import socket

from flask import Blueprint
from flask import Response
from flask import request
from flask import stream_with_context
from werkzeug.exceptions import ClientDisconnected
from werkzeug.exceptions import RequestTimeout
from werkzeug.exceptions import UnsupportedMediaType

from api import params
from api import services
from api.auth import caller
from api.body import BodyDeadline
from api.body import TooSlowBody
from api.errors import error_response
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from thinkbatch import batches
from thinkbatch import files as service
from thinkbatch.jobs import InvalidRequest
from thinkbatch.openai_schemas import FileDeleted
from thinkbatch.openai_schemas import FileList
from thinkbatch.openai_schemas import FileObject
from thinkbatch.openai_schemas import FileUpload

bp = Blueprint("openai_files", __name__, url_prefix="/v1/files")

FILE_ID = {"file_id": ({"type": "string", "pattern": "^file-[0-9a-f]{32}$"}, "A file id.")}
MAX_LIST = 10_000  # OpenAI's bound of `limit` for files
_DIGITS = re.compile(r"[0-9]{1,9}")


@bp.errorhandler(service.FileNotFound)
def _not_found(error: service.FileNotFound) -> tuple[Response, int]:
    return error_response(404, "not_found", "file_not_found", f"no file {error.args[0]!r}")


@bp.errorhandler(service.FileTooLarge)
def _too_large(error: service.FileTooLarge) -> tuple[Response, int]:
    return error_response(413, "invalid_request_error", "file_too_large", str(error), "file")


def _form() -> None:
    """Have werkzeug parse the multipart body (it spools a large file part to disk) before any
    transaction opens, with the same bound on a stalled client as JSON bodies (api.body)."""
    if request.mimetype != "multipart/form-data":
        raise UnsupportedMediaType("the body must be multipart/form-data with a `file` part")
    svc = services()
    sock = request.environ.get("gunicorn.socket")
    if isinstance(sock, socket.socket):
        sock.settimeout(svc.settings.request_read_timeout_s)
    deadline = BodyDeadline(sock, svc.settings, request.content_length)
    try:
        request.files  # noqa: B018 - parses the form
        if deadline.fired:
            raise TooSlowBody(svc.settings.request_min_bytes_per_s)
    except ClientDisconnected as error:
        if deadline.fired:
            raise TooSlowBody(svc.settings.request_min_bytes_per_s) from None
        if isinstance(error.__context__, TimeoutError):
            raise RequestTimeout("the request body stalled") from None
        raise
    finally:
        deadline.cancel()
        if isinstance(sock, socket.socket):
            try:
                sock.settimeout(None)
            except OSError:
                pass


def _field(name: str) -> str | None:
    values = request.form.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"{name}: given {len(values)} times; give it once", param=name)
    if values and "\x00" in values[0]:
        raise InvalidRequest(f"{name}: must not contain NUL (\\u0000)", param=name)
    return values[0] if values else None


@bp.post("")
@describe(
    Doc(
        summary="Upload a file (JSONL of batch requests), stored in chunks as it is read.",
        body=FileUpload,
        body_media="multipart/form-data",
        responses={200: FileObject},
        errors=(400, 408, 413, 415),
        tags=("openai",),
    )
)
def upload() -> dict[str, object]:
    svc = services()
    _form()
    uploads = request.files.getlist("file")
    if len(uploads) != 1:
        raise InvalidRequest("file: give exactly one file part", param="file")
    purpose = _field("purpose")
    if purpose is None:
        raise InvalidRequest("purpose: Field required", param="purpose")
    expires = service.check_expires_after(
        _field("expires_after[anchor]"), _field("expires_after[seconds]")
    )
    filename = service.check_filename(uploads[0].filename)
    with svc.sessions.begin() as session:
        record = service.store_upload(
            session,
            caller(),
            uploads[0].stream,
            filename=filename,
            purpose=purpose,
            expires_after_s=expires,
            settings=svc.settings,
        )
        return service.file_out(record)


def _limit() -> int:
    raw = params.single("limit")
    if raw is None:
        return MAX_LIST
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_LIST:
        raise InvalidRequest(f"limit: must be an integer from 1 to {MAX_LIST}", param="limit")
    return int(raw)


@bp.get("")
@describe(
    Doc(
        summary="List files.",
        query=(
            Query("after", {"type": "string"}, "The last file id of the page before."),
            Query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIST,
                            "default": MAX_LIST}, "Page size."),
            Query("order", {"type": "string", "enum": ["asc", "desc"], "default": "desc"},
                  "By creation time."),
            Query("purpose", {"type": "string"}, "Only files of this purpose."),
        ),
        responses={200: FileList},
        errors=(400,),
        tags=("openai",),
    )
)  # fmt: skip
def list_() -> dict[str, object]:
    svc = services()
    order = params.single("order") or "desc"
    if order not in ("asc", "desc"):
        raise InvalidRequest("order: must be asc or desc", param="order")
    after, limit, purpose = params.single("after") or None, _limit(), params.single("purpose")
    with svc.sessions() as session:
        return service.list_files(
            session, caller(), after=after, limit=limit, order=order, purpose=purpose
        )


@bp.get("/<file_id>")
@describe(Doc(summary="A file.", path=FILE_ID, responses={200: FileObject}, errors=(404,),
              tags=("openai",)))  # fmt: skip
def get(file_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions() as session:
        return service.file_out(service.get_file(session, caller(), service.parse_file_id(file_id)))


@bp.delete("/<file_id>")
@describe(Doc(summary="Delete a file.", path=FILE_ID, responses={200: FileDeleted},
              errors=(404,), tags=("openai",)))  # fmt: skip
def delete(file_id: str) -> dict[str, object]:
    svc = services()
    with svc.sessions.begin() as session:
        return service.delete_file(session, caller(), service.parse_file_id(file_id))


@bp.get("/<file_id>/content")
@describe(
    Doc(
        summary="A file's bytes, streamed.",
        path=FILE_ID,
        responses={200: "application/octet-stream"},
        errors=(404,),
        tags=("openai",),
    )
)
def content(file_id: str) -> Response:
    svc = services()
    stream = batches.iter_file(svc.engine, caller(), service.parse_file_id(file_id))
    return Response(stream_with_context(stream), mimetype="application/octet-stream")
