"""A submission's writes: the job row, its items by COPY, and the job's settings once every
item is in (a streamed body may give them last). All in the caller's transaction, under the
tenant's advisory lock (`lock_tenant`), which serializes a tenant's own submissions so that its
quotas and its idempotency keys hold under parallel submits."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

from thinkbatch.models import Job

# An item is stored pending, or failed when its request was refused (thinkbatch/jobs/create.py,
# RefusedItem): the insert trigger counts it with the job's failed items, never as unfinished.
_COPY_ITEMS = (
    "COPY items (job_id, seq, custom_id, messages, prompt, params, status, error_code, "
    "error_message, error_param, finished_at, model, prefix_key) FROM STDIN"
)


def lock_tenant(conn: sa.Connection, tenant: str) -> datetime:
    """Until the transaction ends, this tenant's other submissions wait here. Returns the
    transaction's time (its first statement is this one), which a job stored in it is created
    at: every other time the transaction writes (a refused job's `finished_at`) is the same
    database clock's now(), so none of them is ever earlier than the job's creation, whatever
    the wait for the lock and whatever the API host's clock says."""
    now: datetime = conn.execute(
        sa.text("SELECT now() FROM pg_advisory_xact_lock(hashtextextended(:key, 0))"),
        {"key": f"thinkbatch-tenant:{tenant}"},
    ).scalar_one()
    return now


@dataclass(frozen=True, slots=True)
class NewJob:
    """The job row a submission starts with."""

    id: uuid.UUID
    tenant: str
    model: str
    created_at: datetime
    expires_at: datetime
    idempotency_key: str | None = None
    request_digest: bytes | None = None
    # Set for a batch of the OpenAI API (thinkbatch/openai): where it came from.
    endpoint: str | None = None
    input_file_id: uuid.UUID | None = None
    completion_window_text: str | None = None
    output_expires_after_s: int | None = None


def insert_job(conn: sa.Connection, job: NewJob) -> None:
    conn.execute(
        sa.insert(Job).values(
            id=job.id,
            tenant=job.tenant,
            status="queued",
            model=job.model,
            params={},
            meta={},
            created_at=job.created_at,
            expires_at=job.expires_at,
            idempotency_key=job.idempotency_key,
            request_digest=job.request_digest,
            endpoint=job.endpoint,
            input_file_id=job.input_file_id,
            completion_window_text=job.completion_window_text,
            output_expires_after_s=job.output_expires_after_s,
        )
    )


def copy_items(conn: sa.Connection, rows: Iterator[tuple[object, ...]]) -> None:
    """Write the rows (job_id, seq, custom_id, messages, prompt, params, status, error_code,
    error_message, error_param, finished_at, model, prefix_key) as they come: COPY streams
    them, so the submission's memory does not grow with its size."""
    driver = conn.connection.driver_connection
    assert driver is not None
    with driver.cursor() as cursor, cursor.copy(_COPY_ITEMS) as copy:
        for row in rows:
            copy.write_row(row)


def stored_items(conn: sa.Connection, job_id: uuid.UUID) -> tuple[int, int]:
    """Items stored for the job so far in this transaction, and how many of them are left to
    run (not refused): its counts, kept by the insert trigger (a job being stored has no
    writers' deltas yet: its row is all of them)."""
    query = sa.select(Job.total, Job.unfinished_folded).where(Job.id == job_id)
    total, unfinished = conn.execute(query).one()
    return int(total), int(unfinished)


def settle_job(
    conn: sa.Connection,
    job_id: uuid.UUID,
    *,
    model: str,
    models: list[str],
    params: dict[str, Any],
    metadata: dict[str, str] | None,
    priority: int,
    expires_at: datetime,
) -> None:
    """The job's settings, once its items are stored: its model, the distinct models of its
    items, and what its header says."""
    conn.execute(
        sa.update(Job)
        .where(Job.id == job_id)
        .values(
            model=model,
            models=models,
            params=params,
            meta=sa.cast(metadata, JSONB) if metadata is not None else sa.null(),
            priority=priority,
            expires_at=expires_at,
        )
    )


def insert_refused_job(
    conn: sa.Connection, job: NewJob, *, errors: list[dict[str, Any]], metadata: Any
) -> None:
    """A submission refused as a whole for what its input holds (a batch whose file has bad
    lines): stored `failed`, with the errors and no items, so that it can be shown."""
    insert_job(conn, job)
    conn.execute(
        sa.update(Job)
        .where(Job.id == job.id)
        .values(
            status="failed",
            finished_at=sa.func.now(),
            error_code="invalid_input_file",
            error_message=f"{len(errors)} line(s) of the input file are invalid",
            batch_errors=errors,
            meta=sa.cast(metadata, JSONB) if metadata is not None else sa.null(),
        )
    )


def find_by_key(
    conn: sa.Connection, tenant: str, key: str
) -> tuple[uuid.UUID, bytes | None] | None:
    """The job a tenant's idempotency key made, with the digest of the request that made it."""
    row = conn.execute(
        sa.select(Job.id, Job.request_digest).where(
            Job.tenant == tenant, Job.idempotency_key == key
        )
    ).first()
    return (row.id, row.request_digest) if row is not None else None


# What the pages, the status filters, the after= lookup and the claims select items by.
_SELECTED_BY = ("job_id", "status", "seq", "custom_id", "model", "prefix_key", "crashes")


def analyze_items(engine: sa.Engine, lock_timeout_ms: int = 200) -> bool:
    """Refresh the planner's statistics of `items` (ANALYZE), as after any bulk load; False when
    another ANALYZE (autovacuum's) held the table for `lock_timeout_ms`, and is doing it.

    A job the statistics have not seen is planned as a small one: while the table holds fewer
    jobs than the statistics keep values (100), any new job is taken for a single row. A page
    of a large job then read the whole job, and the `after=` lookup of its custom_id went by
    the wrong index: 15 ms a deep page of a 50,000-item job here, against under 1 ms.

    Only the columns that reads and claims select items by are analyzed: on a table of
    80,000 items here, every column's statistics took 190 ms of Postgres and these columns'
    53 ms (the messages' jsonb and the other text columns are the rest). Autovacuum keeps
    the other columns' statistics as it always has."""
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f"SET LOCAL lock_timeout = {int(lock_timeout_ms)}"))
            conn.execute(sa.text(f"ANALYZE items ({', '.join(_SELECTED_BY)})"))
    except sa.exc.OperationalError as error:
        if "lock timeout" not in str(error):
            raise
        return False
    return True
