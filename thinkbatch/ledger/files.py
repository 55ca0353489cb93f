"""Files of the OpenAI Files API: an upload's row and its chunks as they are read, a deletion,
the expiry of files past their time, and the rows of a finished batch's output files."""

from __future__ import annotations

import uuid
from datetime import datetime
from datetime import timedelta

import sqlalchemy as sa

from thinkbatch.models import File
from thinkbatch.models import FileChunk
from thinkbatch.models import FileKind
from thinkbatch.models import Job


def insert_upload(
    conn: sa.Connection,
    *,
    tenant: str,
    filename: str,
    purpose: str,
    created_at: datetime,
    expires_at: datetime | None,
) -> uuid.UUID:
    file_id = uuid.uuid4()
    conn.execute(
        sa.insert(File).values(
            id=file_id,
            tenant=tenant,
            kind=FileKind.upload,
            purpose=purpose,
            filename=filename,
            bytes=0,
            created_at=created_at,
            expires_at=expires_at,
        )
    )
    return file_id


def insert_chunk(conn: sa.Connection, file_id: uuid.UUID, seq: int, data: bytes) -> None:
    conn.execute(sa.insert(FileChunk).values(file_id=file_id, seq=seq, data=data))


def set_size(conn: sa.Connection, file_id: uuid.UUID, size: int) -> None:
    conn.execute(sa.update(File).where(File.id == file_id).values(bytes=size))


def delete_file(conn: sa.Connection, file_id: uuid.UUID) -> None:
    """Gone for its tenant at once; an upload's bytes are removed, the row stays (so that a
    finished batch never makes a deleted output file again)."""
    conn.execute(sa.update(File).where(File.id == file_id).values(deleted_at=sa.func.now()))
    conn.execute(sa.delete(FileChunk).where(FileChunk.file_id == file_id))


_EXPIRE = sa.text(
    """
    WITH gone AS (
        UPDATE files SET deleted_at = now()
        WHERE id IN (
            SELECT id FROM files
            WHERE expires_at <= now() AND deleted_at IS NULL
            ORDER BY expires_at LIMIT :n FOR UPDATE SKIP LOCKED
        )
        RETURNING id
    ), chunks AS (
        DELETE FROM file_chunks WHERE file_id IN (SELECT id FROM gone)
    )
    SELECT id FROM gone
    """
)


def expire_files(conn: sa.Connection, limit: int) -> int:
    """Files past their expires_at: their bytes go (the row stays, marked deleted, as a
    deletion leaves it), at most `limit` a call so that one sweep never runs long."""
    return len(conn.execute(_EXPIRE, {"n": limit}).all())


def insert_outputs(conn: sa.Connection, job_id: uuid.UUID, sizes: dict[FileKind, int]) -> bool:
    """The rows of a finished batch's output (and error) files, of the sizes given, once:
    the job's row is locked, and a job that has them already is left alone. False then."""
    job = conn.execute(
        sa.select(Job.id, Job.tenant, Job.output_file_id, Job.output_expires_after_s)
        .where(Job.id == job_id)
        .with_for_update()
    ).first()
    if job is None or job.output_file_id is not None:
        return False
    now = conn.execute(sa.select(sa.func.now())).scalar_one()
    made: dict[FileKind, uuid.UUID] = {}
    for kind, size in sizes.items():
        made[kind] = uuid.uuid4()
        conn.execute(
            sa.insert(File).values(
                id=made[kind],
                tenant=job.tenant,
                kind=kind,
                purpose="batch_output",
                filename=f"batch_{job_id.hex}_{kind.value}.jsonl",
                bytes=size,
                job_id=job_id,
                created_at=now,
                expires_at=(
                    now + timedelta(seconds=job.output_expires_after_s)
                    if job.output_expires_after_s
                    else None
                ),
            )
        )
    conn.execute(
        sa.update(Job)
        .where(Job.id == job_id)
        .values(output_file_id=made[FileKind.output], error_file_id=made.get(FileKind.error))
    )
    return True
