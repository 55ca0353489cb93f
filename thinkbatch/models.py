"""The tables: jobs, their items, one result row per succeeded item, and the live workers.

Postgres is the system of record. An item is claimed with a lease and an attempt counter; its
result is a row whose primary key is the item id, so an item can never hold two results.
A job's per-status counts and token usage are kept on its row (a submission's insert trigger
counts its items; the ledger's statements that end items add the rest: ledger/counts.py), so a
status call reads one row however large the job is, and the job's running items by an index.
"""

from __future__ import annotations

import enum
import uuid
from datetime import datetime
from typing import Any
from typing import ClassVar

import sqlalchemy as sa
from sqlalchemy import orm
from sqlalchemy.dialects.postgresql import JSONB


class Base(orm.DeclarativeBase):
    metadata: ClassVar[sa.MetaData] = sa.MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        dict[str, Any]: JSONB,
        datetime: sa.DateTime(timezone=True),
    }


class JobStatus(enum.StrEnum):
    queued = "queued"
    running = "running"
    completed = "completed"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"
    expired = "expired"


class ItemStatus(enum.StrEnum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"


ACTIVE_JOB_STATUSES = (JobStatus.queued, JobStatus.running, JobStatus.cancelling)
TERMINAL_JOB_STATUSES = (
    JobStatus.completed,
    JobStatus.failed,
    JobStatus.cancelled,
    JobStatus.expired,
)


# The tenant of jobs made with authentication off (and of every job made before tenants).
DEFAULT_TENANT = "default"


def _status_enum(enum_cls: type[enum.Enum], name: str) -> sa.Enum:
    # A CHECK constraint instead of a native ENUM type: adding a status is then a plain
    # constraint swap in a migration, not an ALTER TYPE.
    return sa.Enum(
        enum_cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
    )


def _utcnow() -> datetime:
    from datetime import UTC

    return datetime.now(UTC)


# The columns of items that Job.running counts by, declared here because Job comes first.
_ITEMS = sa.table("items", sa.column("job_id"), sa.column("status"))

# The constants of the counts below, written into the SQL rather than bound. A status call reads
# them as a server-side prepared statement, and Postgres keeps its generic plan (planned once per
# connection) only if it costs no more than a plan for the call's values: `status = $5` is
# costed at an average status's share of the job, `status = 'running'` at the few running
# items, so with the value bound every call was planned again (about 300 us of Postgres CPU,
# against 15 to run it; tests/unit/test_plan_reuse.py).
_ZERO = sa.literal_column("0", sa.Integer)
_RUNNING = sa.literal_column("'running'", sa.String)


# A worker's stores add to a job's counts in its own row of job_count_deltas (ledger/counts.py);
# the job's row takes the sums when the job is finalized and on each pass of the sweeper.
_DELTAS = sa.table(
    "job_count_deltas",
    sa.column("job_id"),
    *(sa.column(name) for name in ("succeeded", "failed", "cancelled", "expired")),
    *(sa.column(name) for name in ("prompt_tokens", "completion_tokens", "reasoning_tokens")),
)


def _with_deltas(
    job_id: Any, folded_unfinished: Any, stored: Any, delta: Any, *, subtract: bool = False
) -> sa.ColumnElement[int]:
    """A count as read: the job's row (`stored`) plus the sum of its writers' `delta`s. A job
    whose row holds nothing unfinished has no deltas (each counts items that its row still
    holds unfinished), and they are not looked up."""
    added = (
        sa.select(sa.func.coalesce(sa.func.sum(delta), _ZERO))
        .where(_DELTAS.c.job_id == job_id)
        .scalar_subquery()
    )
    return sa.case(
        (folded_unfinished == _ZERO, stored), else_=stored - added if subtract else stored + added
    )


def _unfinished(job_id: Any, folded_unfinished: Any) -> sa.ColumnElement[int]:
    """Pending and running items as read: the row's, less the items its writers ended."""
    ended = _DELTAS.c.succeeded + _DELTAS.c.failed + _DELTAS.c.cancelled + _DELTAS.c.expired
    return _with_deltas(job_id, folded_unfinished, folded_unfinished, ended, subtract=True)


def _running_items(job_id: Any, unfinished: Any) -> sa.ColumnElement[int]:
    """The number of the job's running items, as a subquery of a SELECT from jobs. A job with
    nothing unfinished has none running, and is not looked up: after a big job finishes, its
    index range still holds the dead entries of its running items until a vacuum, and every
    poll of it would walk them."""
    count = (
        sa.select(sa.func.count())
        .select_from(_ITEMS)
        .where(_ITEMS.c.job_id == job_id, _ITEMS.c.status == _RUNNING)
        .scalar_subquery()
    )
    return sa.case((unfinished == _ZERO, _ZERO), else_=count)


class Job(Base):
    __tablename__ = "jobs"

    id: orm.Mapped[uuid.UUID] = orm.mapped_column(primary_key=True, default=uuid.uuid4)
    status: orm.Mapped[JobStatus] = orm.mapped_column(
        _status_enum(JobStatus, "status"), default=JobStatus.queued
    )
    # The owner: every read and write of a job is scoped by it (thinkbatch/jobs.py).
    tenant: orm.Mapped[str] = orm.mapped_column(
        sa.String(64), default=DEFAULT_TENANT, server_default=DEFAULT_TENANT
    )
    model: orm.Mapped[str] = orm.mapped_column(sa.String(256))
    # The distinct models of its items (a batch file may mix them): its hints go to each one's
    # queue, and a job shows the ones no live worker serves.
    models: orm.Mapped[list[str]] = orm.mapped_column(
        JSONB, default=list, server_default=sa.text("'[]'::jsonb")
    )
    # json, not jsonb: jsonb sorts keys, and a schema's property order is its answer's order.
    params: orm.Mapped[dict[str, Any]] = orm.mapped_column(sa.JSON, default=dict)
    # NULL when the request gave none: a batch echoes `metadata: {}` and a missing one apart.
    meta: orm.Mapped[dict[str, Any] | None] = orm.mapped_column("metadata", default=dict)
    priority: orm.Mapped[int] = orm.mapped_column(default=0)
    created_at: orm.Mapped[datetime] = orm.mapped_column(default=_utcnow)
    started_at: orm.Mapped[datetime | None]
    finished_at: orm.Mapped[datetime | None]
    expires_at: orm.Mapped[datetime]
    # Last sign of life: an enqueue, or a heartbeat of a task driving the job. The sweeper
    # re-enqueues jobs with pending items whose hint went stale (a lost Redis message).
    hinted_at: orm.Mapped[datetime | None]
    error_code: orm.Mapped[str | None] = orm.mapped_column(sa.String(64))
    error_message: orm.Mapped[str | None] = orm.mapped_column(sa.Text)

    # Kept by the insert trigger on items and by the ledger (ledger/counts.py) alone.
    total: orm.Mapped[int] = orm.mapped_column(default=0, server_default="0")
    # The counts the job's row holds (`*_folded`, the columns) and the counts as read, which
    # add its writers' deltas (job_count_deltas, migration 0009). `unfinished`: pending and
    # running together; a claim moves items between the two and so leaves the job row alone,
    # and does not wait for a store of the same job to commit (migration 0004).
    unfinished_folded: orm.Mapped[int] = orm.mapped_column(
        "unfinished", default=0, server_default="0"
    )
    succeeded_folded: orm.Mapped[int] = orm.mapped_column(
        "succeeded", default=0, server_default="0"
    )
    failed_folded: orm.Mapped[int] = orm.mapped_column("failed", default=0, server_default="0")
    cancelled_folded: orm.Mapped[int] = orm.mapped_column(
        "cancelled", default=0, server_default="0"
    )
    expired_folded: orm.Mapped[int] = orm.mapped_column("expired", default=0, server_default="0")
    prompt_tokens_folded: orm.Mapped[int] = orm.mapped_column(
        "prompt_tokens", sa.BigInteger, default=0, server_default="0"
    )
    completion_tokens_folded: orm.Mapped[int] = orm.mapped_column(
        "completion_tokens", sa.BigInteger, default=0, server_default="0"
    )
    reasoning_tokens_folded: orm.Mapped[int] = orm.mapped_column(
        "reasoning_tokens", sa.BigInteger, default=0, server_default="0"
    )
    unfinished: orm.Mapped[int] = orm.column_property(_unfinished(id, unfinished_folded))
    # The split, read from the items in the same statement (one index range of the job's
    # running items, at most the workers' windows), so the two always add up to `unfinished`.
    running: orm.Mapped[int] = orm.column_property(_running_items(id, unfinished_folded))
    pending: orm.Mapped[int] = orm.column_property(
        _unfinished(id, unfinished_folded) - _running_items(id, unfinished_folded)
    )
    succeeded: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, succeeded_folded, _DELTAS.c.succeeded)
    )
    failed: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, failed_folded, _DELTAS.c.failed)
    )
    cancelled: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, cancelled_folded, _DELTAS.c.cancelled)
    )
    expired: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, expired_folded, _DELTAS.c.expired)
    )
    prompt_tokens: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, prompt_tokens_folded, _DELTAS.c.prompt_tokens)
    )
    completion_tokens: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, completion_tokens_folded, _DELTAS.c.completion_tokens)
    )
    reasoning_tokens: orm.Mapped[int] = orm.column_property(
        _with_deltas(id, unfinished_folded, reasoning_tokens_folded, _DELTAS.c.reasoning_tokens)
    )

    # A job made through the OpenAI Batch API (`endpoint` set) and what that API shows of it.
    # (`idempotency_key` serves every submission, native ones too.)
    endpoint: orm.Mapped[str | None] = orm.mapped_column(sa.String(32))
    input_file_id: orm.Mapped[uuid.UUID | None]
    completion_window_text: orm.Mapped[str | None] = orm.mapped_column(sa.String(16))
    idempotency_key: orm.Mapped[str | None] = orm.mapped_column(sa.String(255))
    # SHA-256 of the request that made the job under its idempotency key: a retry of the
    # same request gets the job back, another request under the same key a 400.
    request_digest: orm.Mapped[bytes | None] = orm.mapped_column(sa.LargeBinary(32))
    cancelling_at: orm.Mapped[datetime | None]
    batch_errors: orm.Mapped[list[dict[str, Any]] | None] = orm.mapped_column(JSONB)
    # Set once the job is finished (its output is then fixed); see thinkbatch/batches.py.
    output_file_id: orm.Mapped[uuid.UUID | None]
    error_file_id: orm.Mapped[uuid.UUID | None]
    # The batch's output_expires_after: its output and error files expire this long after
    # they are made.
    output_expires_after_s: orm.Mapped[int | None]

    __table_args__ = (
        # Newest-first listing (a tenant's own) and the sweeper's scan of live jobs.
        sa.Index("ix_jobs_created_at_id", "created_at", "id"),
        sa.Index("ix_jobs_tenant_created_at_id", "tenant", "created_at", "id"),
        sa.Index(
            "ix_jobs_active",
            "status",
            postgresql_where=sa.text("status IN ('queued', 'running', 'cancelling')"),
        ),
        # A repeated Idempotency-Key of a tenant finds its batch; the index makes it unique.
        sa.Index(
            "ix_jobs_tenant_idempotency_key",
            "tenant",
            "idempotency_key",
            unique=True,
            postgresql_where=sa.text("idempotency_key IS NOT NULL"),
        ),
        sa.Index(
            "ix_jobs_batches",
            "tenant",
            "created_at",
            "id",
            postgresql_where=sa.text("endpoint IS NOT NULL"),
        ),
        # Finished batches whose output files are still to be made (thinkbatch/batches.py).
        sa.Index(
            "ix_jobs_batches_unfiled",
            "finished_at",
            postgresql_where=sa.text(
                "endpoint IS NOT NULL AND output_file_id IS NULL AND batch_errors IS NULL "
                "AND status IN ('completed', 'failed', 'cancelled', 'expired')"
            ),
        ),
    )


class JobCountDelta(Base):
    """What one writer's stores added to a job's counts since the job's row last took them
    (ledger/counts.py): a row per (job, writer), which no other writer touches."""

    __tablename__ = "job_count_deltas"

    job_id: orm.Mapped[uuid.UUID] = orm.mapped_column(
        sa.ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    writer: orm.Mapped[str] = orm.mapped_column(sa.String(128), primary_key=True)
    succeeded: orm.Mapped[int] = orm.mapped_column(server_default="0")
    failed: orm.Mapped[int] = orm.mapped_column(server_default="0")
    cancelled: orm.Mapped[int] = orm.mapped_column(server_default="0")
    expired: orm.Mapped[int] = orm.mapped_column(server_default="0")
    prompt_tokens: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, server_default="0")
    completion_tokens: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, server_default="0")
    reasoning_tokens: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, server_default="0")


class Item(Base):
    __tablename__ = "items"

    id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, sa.Identity(), primary_key=True)
    # No foreign key: only the submission's COPY writes items, in the transaction that inserted
    # their job; the key's check per row was a sixth of that COPY (migration 0011). A deleted
    # job's items go with it (the trigger tb_jobs_delete_items).
    job_id: orm.Mapped[uuid.UUID]
    seq: orm.Mapped[int]
    custom_id: orm.Mapped[str] = orm.mapped_column(sa.String(128))
    # The served name it runs on (a base model or a LoRA adapter); NULL: its job's model.
    # Claims take only the items of the names a worker serves (thinkbatch/ledger/claims.py).
    model: orm.Mapped[str | None] = orm.mapped_column(sa.String(256))
    messages: orm.Mapped[list[dict[str, Any]] | None] = orm.mapped_column(JSONB)
    prompt: orm.Mapped[str | None] = orm.mapped_column(sa.Text)
    params: orm.Mapped[dict[str, Any] | None] = orm.mapped_column(sa.JSON)
    status: orm.Mapped[ItemStatus] = orm.mapped_column(
        _status_enum(ItemStatus, "status"), default=ItemStatus.pending
    )
    # Counted at claim. With lease_owner it fences writes: a result is stored only if the
    # item is still running under the same owner and attempt that produced it.
    attempts: orm.Mapped[int] = orm.mapped_column(default=0, server_default="0")
    # Engine deaths this item was in flight for; drives poison-item isolation.
    crashes: orm.Mapped[int] = orm.mapped_column(default=0, server_default="0")
    lease_owner: orm.Mapped[str | None] = orm.mapped_column(sa.String(128))
    lease_expires_at: orm.Mapped[datetime | None]
    started_at: orm.Mapped[datetime | None]
    finished_at: orm.Mapped[datetime | None]
    error_code: orm.Mapped[str | None] = orm.mapped_column(sa.String(64))
    error_message: orm.Mapped[str | None] = orm.mapped_column(sa.Text)
    # The field a refused line's error names (an OpenAI error file's `param`).
    error_param: orm.Mapped[str | None] = orm.mapped_column(sa.String(256))
    # Claims take pending items in this order (CLAIM_ORDER=prefix): items whose prompts
    # begin alike are next to each other (thinkbatch/jobs/prefix.py). NULL: a refused item,
    # one stored with CLAIM_ORDER=submitted, or one of a job stored before migration 0010;
    # those come last, in seq order.
    prefix_key: orm.Mapped[bytes | None] = orm.mapped_column(sa.LargeBinary)

    __table_args__ = (
        sa.UniqueConstraint("job_id", "seq"),
        sa.UniqueConstraint("job_id", "custom_id"),
        # A line refused for its body is stored failed, with no input (thinkbatch/openai).
        sa.CheckConstraint(
            "(messages IS NULL) <> (prompt IS NULL) "
            "OR (messages IS NULL AND prompt IS NULL AND status = 'failed')",
            name="one_input",
        ),
        # Status-filtered pages, counts of running items, suspects' claims.
        sa.Index("ix_items_job_id_status_seq", "job_id", "status", "seq"),
        # Claims: a job's pending items of one model (NULL: the job's own) in claim order
        # (thinkbatch/ledger/claims.py). Partial on pending items, so that a claim or a store,
        # which move an item out of `pending`, add no entry to it.
        sa.Index(
            "ix_items_pending",
            "job_id",
            "model",
            "prefix_key",
            "seq",
            postgresql_where=sa.text("status = 'pending' AND crashes = 0"),
        ),
        # Crash suspects: the pending items that were in flight when an engine died. They are
        # few, and every claim that comes back empty asks whether the job has any: without
        # this index that question read every pending item of the job.
        sa.Index(
            "ix_items_pending_suspects",
            "job_id",
            "crashes",
            "seq",
            postgresql_where=sa.text("status = 'pending' AND crashes > 0"),
        ),
        # The sweeper's scan for lapsed leases and dead owners.
        sa.Index(
            "ix_items_running_lease",
            "lease_expires_at",
            postgresql_where=sa.text("status = 'running'"),
        ),
    )


class ItemResult(Base):
    __tablename__ = "item_results"

    # No foreign keys: only the store's statement writes a result, joined to the item row it
    # has just updated (the keys' per-row checks were a quarter of a store; migration 0008).
    # A deleted item's result goes with it (the trigger tb_items_delete_results).
    item_id: orm.Mapped[int] = orm.mapped_column(sa.BigInteger, primary_key=True)
    job_id: orm.Mapped[uuid.UUID] = orm.mapped_column(index=True)
    attempt: orm.Mapped[int]
    thinking: orm.Mapped[str] = orm.mapped_column(sa.Text)
    answer: orm.Mapped[str] = orm.mapped_column(sa.Text)
    finish_reason: orm.Mapped[str] = orm.mapped_column(sa.String(32))
    thinking_truncated: orm.Mapped[bool]
    prompt_tokens: orm.Mapped[int]
    completion_tokens: orm.Mapped[int]
    reasoning_tokens: orm.Mapped[int]
    # Every choice (thinking, answer, finish reason, tool calls, logprobs) of an item that asked
    # for more than the plain one; NULL otherwise (the columns above are its one choice).
    choices: orm.Mapped[list[dict[str, Any]] | None] = orm.mapped_column(JSONB)
    worker_id: orm.Mapped[str] = orm.mapped_column(sa.String(128))
    created_at: orm.Mapped[datetime] = orm.mapped_column(server_default=sa.func.now())


class Worker(Base):
    """A live (or recently dead) worker process; its heartbeat decides whether its leases stand."""

    __tablename__ = "workers"

    id: orm.Mapped[str] = orm.mapped_column(sa.String(128), primary_key=True)
    hostname: orm.Mapped[str] = orm.mapped_column(sa.String(256))
    pid: orm.Mapped[int]
    model: orm.Mapped[str] = orm.mapped_column(sa.String(256))
    # The LoRA adapters it serves beside its base model (their served names).
    adapters: orm.Mapped[list[str] | None] = orm.mapped_column(JSONB)
    # What the API needs to refuse, at submit, an item that cannot fit the model (api: the
    # context check): the engine's context, the most bytes one token of its tokenizer covers,
    # and the fewest tokens its chat template adds per message. NULL: not known.
    max_model_len: orm.Mapped[int | None]
    token_bytes_max: orm.Mapped[int | None]
    message_tokens_min: orm.Mapped[int | None]
    started_at: orm.Mapped[datetime] = orm.mapped_column(server_default=sa.func.now())
    heartbeat_at: orm.Mapped[datetime] = orm.mapped_column(server_default=sa.func.now())
    stopped_at: orm.Mapped[datetime | None]


class ApiKey(Base):
    """An API key of a tenant. Only a hash of the key is stored; its prefix identifies it in
    listings and logs without revealing it."""

    __tablename__ = "api_keys"

    id: orm.Mapped[uuid.UUID] = orm.mapped_column(primary_key=True, default=uuid.uuid4)
    tenant: orm.Mapped[str] = orm.mapped_column(sa.String(64))
    name: orm.Mapped[str] = orm.mapped_column(sa.String(128), default="")
    prefix: orm.Mapped[str] = orm.mapped_column(sa.String(16), unique=True)
    # SHA-256 of the whole key. Keys are 256-bit random secrets, so a fast hash is enough:
    # a slow password hash guards low-entropy secrets, which these are not.
    key_hash: orm.Mapped[bytes] = orm.mapped_column(sa.LargeBinary(32))
    created_at: orm.Mapped[datetime] = orm.mapped_column(default=_utcnow)
    revoked_at: orm.Mapped[datetime | None]


class FileKind(enum.StrEnum):
    upload = "upload"  # bytes stored in file_chunks
    output = "output"  # a batch's output file, streamed from its results
    error = "error"  # a batch's error file, streamed from its results


class File(Base):
    """A file of the OpenAI Files API. An upload's bytes are rows of `file_chunks`; a batch's
    output and error files hold no bytes and are rendered from the results on each read."""

    __tablename__ = "files"

    id: orm.Mapped[uuid.UUID] = orm.mapped_column(primary_key=True, default=uuid.uuid4)
    tenant: orm.Mapped[str] = orm.mapped_column(sa.String(64))
    kind: orm.Mapped[FileKind] = orm.mapped_column(_status_enum(FileKind, "kind"))
    purpose: orm.Mapped[str] = orm.mapped_column(sa.String(32))
    filename: orm.Mapped[str] = orm.mapped_column(sa.String(256))
    bytes: orm.Mapped[int] = orm.mapped_column(sa.BigInteger)
    job_id: orm.Mapped[uuid.UUID | None] = orm.mapped_column(
        sa.ForeignKey("jobs.id", ondelete="CASCADE")
    )
    created_at: orm.Mapped[datetime] = orm.mapped_column(default=_utcnow)
    expires_at: orm.Mapped[datetime | None]
    # A deleted file is gone for its tenant; the row stays so a batch never re-creates it.
    deleted_at: orm.Mapped[datetime | None]

    __table_args__ = (
        sa.Index("ix_files_tenant_created_at_id", "tenant", "created_at", "id"),
        sa.UniqueConstraint("job_id", "kind"),
    )


class FileChunk(Base):
    __tablename__ = "file_chunks"

    file_id: orm.Mapped[uuid.UUID] = orm.mapped_column(
        sa.ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    seq: orm.Mapped[int] = orm.mapped_column(primary_key=True)
    data: orm.Mapped[bytes] = orm.mapped_column(sa.LargeBinary)
