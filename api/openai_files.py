"""/v1/files: the OpenAI Files API (uploads for batches, and batches' output files)."""

from __future__ import annotations

from flask import Blueprint
from flask import Response
from flask import request
from flask import stream_with_context
from werkzeug.exceptions import UnsupportedMediaType

from api import params
from api.auth import caller
from api.body import spool
from api.form import Form
from api.form import parse as parse_form
from api.openapi import Doc
from api.openapi import Query
from api.openapi import describe
from api.replies import json_reply
from api.services import services
from thinkbatch.errors import InputError
from thinkbatch.guard import check_text
from thinkbatch.openai import batches
from thinkbatch.openai import files as service
from thinkbatch.openai.wire import FileDeleted
from thinkbatch.openai.wire import FileList
from thinkbatch.openai.wire import FileObject
from thinkbatch.openai.wire import FileUpload

bp = Blueprint("openai_files", __name__, url_prefix="/v1/files")

FILE_ID = {"file_id": ({"type": "string", "pattern": "^file-[0-9a-f]{32}$"}, "A file id.")}
MAX_LIST = 10_000  # OpenAI's bound of `limit` for files
_FIELDS = {"purpose", "expires_after[anchor]", "expires_after[seconds]"}


def _field(form: Form, name: str) -> str | None:
    values = form.fields.get(name, [])
    if len(values) > 1:
        raise InputError(f"{name}: given {len(values)} times; give it once", param=name)
    return check_text(values[0], name) if values else None


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
def upload() -> Response:
    svc = services()
    if request.mimetype != "multipart/form-data":
        raise UnsupportedMediaType("the body must be multipart/form-data with a `file` part")
    # The body is whole by now (api.intake); it is parsed before any transaction opens.
    with spool(svc.settings) as body:
        form = parse_form(
            body,
            request.mimetype_params.get("boundary", ""),
            spool_memory_bytes=svc.settings.spool_memory_bytes,
        )
    try:
        if "file" in form.fields:
            raise InputError(
                "file: send the file as a file part (a Content-Disposition with a filename)",
                param="file",
            )
        unknown = sorted(set(form.fields) - _FIELDS) + sorted(
            {p.name for p in form.files} - {"file"}
        )
        if unknown:
            name = unknown[0][:64]
            raise InputError(
                f"{name}: unknown form field (an upload takes file, purpose and expires_after)",
                param=name,
                code="unknown_parameter",
            )
        if len(form.files) != 1:
            raise InputError(
                f"file: give exactly one file part (got {len(form.files)})", param="file"
            )
        purpose = _field(form, "purpose")
        if purpose is None:
            raise InputError("purpose: Field required", param="purpose")
        expires = service.check_expires_after(
            _field(form, "expires_after[anchor]"), _field(form, "expires_after[seconds]")
        )
        upload = form.files[0]
        filename = service.check_filename(upload.filename)
        with svc.sessions.begin() as session:
            record = service.store_upload(
                session,
                caller(),
                upload.data,
                filename=filename,
                purpose=purpose,
                expires_after_s=expires,
                settings=svc.settings,
            )
            return json_reply(service.file_out(record))
    finally:
        form.close()


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
def list_() -> Response:
    svc = services()
    order = params.single("order") or "desc"  # absent: newest first (empty is refused)
    if order not in ("asc", "desc"):
        raise InputError("order: must be asc or desc", param="order")
    after, limit = params.after(), params.limit(MAX_LIST, MAX_LIST)
    purpose = params.single("purpose")
    with svc.read_sessions() as session:
        page = service.list_files(
            session, caller(), after=after, limit=limit, order=order, purpose=purpose
        )
    return json_reply(page)


@bp.get("/<file_id>")
@describe(Doc(summary="A file.", path=FILE_ID, responses={200: FileObject}, errors=(404,),
              tags=("openai",)))  # fmt: skip
def get(file_id: str) -> Response:
    svc = services()
    with svc.read_sessions() as session:
        found = service.get_file(session, caller(), service.parse_file_id(file_id))
        return json_reply(service.file_out(found))


@bp.delete("/<file_id>")
@describe(Doc(summary="Delete a file.", path=FILE_ID, responses={200: FileDeleted},
              errors=(404,), tags=("openai",)))  # fmt: skip
def delete(file_id: str) -> Response:
    svc = services()
    with svc.sessions.begin() as session:
        gone = service.delete_file(session, caller(), service.parse_file_id(file_id))
        return json_reply(gone)


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
    size, stream = batches.open_file(svc.jobs, caller(), service.parse_file_id(file_id))
    response = Response(stream_with_context(stream), mimetype="application/octet-stream")
    response.content_length = size  # known: an upload's stored bytes, an output's measured ones
    return response
