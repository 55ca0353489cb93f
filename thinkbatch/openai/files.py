"""Files of the OpenAI Files API, kept in Postgres: store, read, list, delete.

An upload is written as rows of FILE_CHUNK_BYTES in `file_chunks` while it is read, so the API
holds one chunk in memory however large the file, and reads stream the rows back through a
server-side cursor. A batch's output and error files store no bytes: they are rendered from the
batch's results on each read (batches.py), their size measured once when the batch finished.
Every query is scoped by the caller's tenant: another tenant's file is not found. The writes
are the ledger's (thinkbatch/ledger/files.py).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from typing import IO

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.errors import FileNotFound
from thinkbatch.errors import InputError
from thinkbatch.guard import check_text
from thinkbatch.keys import Caller
from thinkbatch.models import File
from thinkbatch.models import FileChunk
from thinkbatch.openai.wire import FileDeleted
from thinkbatch.openai.wire import FileList
from thinkbatch.openai.wire import FileObject
from thinkbatch.settings import Settings

UPLOAD_PURPOSES = ("batch",)
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2592000  # OpenAI's bounds of expires_after.seconds
_FILE_ID = re.compile(r"file-([0-9a-f]{32})")


def too_large(limit: int) -> InputError:
    return InputError(
        f"file: larger than the limit of {limit} bytes (MAX_FILE_BYTES)",
        param="file",
        code="file_too_large",
        status=413,
    )


def file_id(key: uuid.UUID) -> str:
    return f"file-{key.hex}"


def parse_file_id(raw: str) -> uuid.UUID:
    match = _FILE_ID.fullmatch(raw)
    if match is None:
        raise FileNotFound(raw)
    return uuid.UUID(match.group(1))


def _unix(value: datetime | None) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_out(f: File) -> FileObject:
    return FileObject(
        id=file_id(f.id),
        object="file",
        bytes=f.bytes,
        created_at=int(f.created_at.timestamp()),
        filename=f.filename,
        purpose=f.purpose,
        status="processed",
        expires_at=_unix(f.expires_at),
    )


def _visible(caller: Caller) -> list[sa.ColumnElement[bool]]:
    return [
        File.tenant == caller.tenant,
        File.deleted_at.is_(None),
        sa.or_(File.expires_at.is_(None), File.expires_at > sa.func.now()),
    ]


def get_file(session: orm.Session, caller: Caller, key: uuid.UUID) -> File:
    found = session.scalar(sa.select(File).where(File.id == key, *_visible(caller)))
    if found is None:
        raise FileNotFound(file_id(key))
    return found


def check_expires_after(anchor: str | None, seconds: str | None) -> int | None:
    """`expires_after[anchor]` and `expires_after[seconds]` of the form, as seconds."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InputError("expires_after.anchor: must be 'created_at'", param="expires_after.anchor")
    if (
        seconds is None
        or not re.fullmatch(r"[0-9]{1,9}", seconds)
        or not (EXPIRES_MIN_S <= int(seconds) <= EXPIRES_MAX_S)
    ):
        raise InputError(
            f"expires_after.seconds: must be an integer from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}",
            param="expires_after.seconds",
        )
    return int(seconds)


MAX_FILENAME_CHARS = 256  # the column's width; a longer name is refused, never cut


def check_filename(name: str | None) -> str:
    name = check_text(name or "upload.jsonl", "file")
    if len(name) > MAX_FILENAME_CHARS:
        raise InputError(
            f"file: the filename has {len(name)} characters; at most {MAX_FILENAME_CHARS}",
            param="file",
            code="filename_too_long",
        )
    return name


def store_upload(
    session: orm.Session,
    caller: Caller,
    stream: IO[bytes],
    *,
    filename: str,
    purpose: str,
    expires_after_s: int | None,
    settings: Settings,
) -> File:
    """Write the stream as chunk rows, reading one chunk at a time; a 413 InputError past
    MAX_FILE_BYTES (the caller's transaction then rolls back)."""
    if purpose not in UPLOAD_PURPOSES:
        raise InputError(f"purpose: must be one of {', '.join(UPLOAD_PURPOSES)}", param="purpose")
    conn = session.connection()
    now = datetime.now(UTC)
    key = ledger.insert_upload(
        conn,
        tenant=caller.tenant,
        filename=filename,
        purpose=purpose,
        created_at=now,
        expires_at=now + timedelta(seconds=expires_after_s) if expires_after_s else None,
    )
    total = seq = 0
    while chunk := _read_full(stream, settings.file_chunk_bytes):
        total += len(chunk)
        if total > settings.max_file_bytes:
            raise too_large(settings.max_file_bytes)
        ledger.insert_chunk(conn, key, seq, chunk)
        seq += 1
    ledger.set_size(conn, key, total)
    record = session.get(File, key)
    assert record is not None
    return record


def _read_full(stream: IO[bytes], size: int) -> bytes:
    """Up to `size` bytes: a stream's read may return less before its end."""
    parts: list[bytes] = []
    want = size
    while want > 0:
        part = stream.read(want)
        if not part:
            break
        parts.append(part)
        want -= len(part)
    return b"".join(parts)


def iter_chunks(engine: sa.Engine, key: uuid.UUID) -> Iterator[bytes]:
    """An upload's bytes, chunk by chunk, through a server-side cursor."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(FileChunk.data)
            .where(FileChunk.file_id == key)
            .order_by(FileChunk.seq)
            .execution_options(yield_per=1)
        )
        for (data,) in rows:
            yield bytes(data)
        # A commit ends these reads as a rollback would, and keeps the pooled connection's
        # prepared statements, which a rollback drops (psycopg; thinkbatch/jobs/service.py).
        conn.commit()


BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, which some Windows tools write first


@dataclass(frozen=True, slots=True)
class LineTooLong:
    """A line longer than the limit, skipped unread."""

    limit: int


def iter_lines(engine: sa.Engine, key: uuid.UUID, max_bytes: int) -> Iterator[bytes | LineTooLong]:
    """An upload's lines (without their line ends), one chunk in memory at a time. A line over
    `max_bytes` is not kept: it comes out as LineTooLong. A leading byte-order mark is not
    part of the first line."""
    line = bytearray()
    too_long = False
    first = True
    for chunk in iter_chunks(engine, key):
        if first:
            first = False
            if chunk.startswith(BOM):
                chunk = chunk[len(BOM) :]
        start = 0
        while True:
            end = chunk.find(b"\n", start)
            piece = chunk[start:] if end < 0 else chunk[start:end]
            if not too_long:
                if len(line) + len(piece) > max_bytes:
                    too_long = True
                    line.clear()
                else:
                    line += piece
            if end < 0:
                break
            yield LineTooLong(max_bytes) if too_long else _ended(line)
            line.clear()
            too_long = False
            start = end + 1
    if too_long:
        yield LineTooLong(max_bytes)
    elif line:
        yield _ended(line)


def _ended(line: bytearray) -> bytes:
    return bytes(line[:-1] if line.endswith(b"\r") else line)


def list_files(
    session: orm.Session,
    caller: Caller,
    *,
    after: str | None,
    limit: int,
    order: str,
    purpose: str | None,
) -> FileList:
    query = sa.select(File).where(*_visible(caller))
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    newest_first = order == "desc"
    key = (File.created_at, File.id)
    if after is not None:
        # Any file of the caller's, deleted ones too: a script that lists a page, deletes its
        # files and asks for the page after the last one must get that page.
        anchor = session.scalar(
            sa.select(File).where(File.id == parse_after(after), File.tenant == caller.tenant)
        )
        if anchor is None:
            raise InputError(f"after: no file {after!r}", param="after")
        cursor = sa.tuple_(*key)
        bound = sa.tuple_(anchor.created_at, anchor.id)
        query = query.where(cursor < bound if newest_first else cursor > bound)
    ordering = [k.desc() for k in key] if newest_first else list(key)
    found = list(session.scalars(query.order_by(*ordering).limit(limit + 1)))
    data = [file_out(f) for f in found[:limit]]
    return FileList(
        object="list",
        data=data,
        first_id=data[0].id if data else None,
        last_id=data[-1].id if data else None,
        has_more=len(found) > limit,
    )


def parse_after(raw: str) -> uuid.UUID:
    match = _FILE_ID.fullmatch(raw)
    if match is None:
        raise InputError("after: must be the id of a file (file-...)", param="after")
    return uuid.UUID(match.group(1))


def delete_file(session: orm.Session, caller: Caller, key: uuid.UUID) -> FileDeleted:
    get_file(session, caller, key)
    ledger.delete_file(session.connection(), key)
    return FileDeleted(id=file_id(key), object="file", deleted=True)
