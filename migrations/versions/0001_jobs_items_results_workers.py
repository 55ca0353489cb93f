"""Jobs, items, item results, workers; triggers that keep job counts and usage

Revision ID: 0001
Revises:
Create Date: 2026-11-30 00:49:29.634820
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

# Job counters are kept by statement-level triggers with transition tables: one UPDATE of the
# job row per statement (a claim of 500 items, a COPY of 100k), whatever code path changed the
# items, so a job's counts always equal a count over its items and a status call reads one row.
COUNT_TRIGGERS_UP = """
CREATE FUNCTION tb_items_counts() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moves text := CASE TG_OP
        WHEN 'INSERT' THEN 'SELECT job_id, status, 1 AS n FROM new_rows'
        WHEN 'DELETE' THEN 'SELECT job_id, status, -1 AS n FROM old_rows'
        ELSE 'SELECT job_id, status, 1 AS n FROM new_rows
              UNION ALL SELECT job_id, status, -1 AS n FROM old_rows'
    END;
BEGIN
    -- Callers lock the affected job rows (in id order) before they touch items, so this
    -- UPDATE only re-takes row locks the transaction already holds.
    EXECUTE format($sql$
        UPDATE jobs AS j SET
            total = j.total + d.total,
            pending = j.pending + d.pending,
            running = j.running + d.running,
            succeeded = j.succeeded + d.succeeded,
            failed = j.failed + d.failed,
            cancelled = j.cancelled + d.cancelled,
            expired = j.expired + d.expired
        FROM (
            SELECT job_id,
                sum(n) AS total,
                coalesce(sum(n) FILTER (WHERE status = 'pending'), 0) AS pending,
                coalesce(sum(n) FILTER (WHERE status = 'running'), 0) AS running,
                coalesce(sum(n) FILTER (WHERE status = 'succeeded'), 0) AS succeeded,
                coalesce(sum(n) FILTER (WHERE status = 'failed'), 0) AS failed,
                coalesce(sum(n) FILTER (WHERE status = 'cancelled'), 0) AS cancelled,
                coalesce(sum(n) FILTER (WHERE status = 'expired'), 0) AS expired
            FROM (%s) AS moves
            GROUP BY job_id
        ) AS d
        WHERE j.id = d.job_id
          AND (d.total, d.pending, d.running, d.succeeded, d.failed, d.cancelled, d.expired)
              <> (0, 0, 0, 0, 0, 0, 0)
    $sql$, moves);
    RETURN NULL;
END
$$;

CREATE TRIGGER tb_items_counts_insert AFTER INSERT ON items
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_items_counts();
CREATE TRIGGER tb_items_counts_update AFTER UPDATE ON items
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION tb_items_counts();
CREATE TRIGGER tb_items_counts_delete AFTER DELETE ON items
    REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_items_counts();

CREATE FUNCTION tb_results_usage() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    UPDATE jobs AS j SET
        prompt_tokens = j.prompt_tokens + u.prompt_tokens,
        completion_tokens = j.completion_tokens + u.completion_tokens,
        reasoning_tokens = j.reasoning_tokens + u.reasoning_tokens
    FROM (
        SELECT job_id, sum(prompt_tokens) AS prompt_tokens,
            sum(completion_tokens) AS completion_tokens, sum(reasoning_tokens) AS reasoning_tokens
        FROM new_rows GROUP BY job_id
    ) AS u
    WHERE j.id = u.job_id;
    RETURN NULL;
END
$$;

CREATE TRIGGER tb_results_usage_insert AFTER INSERT ON item_results
    REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION tb_results_usage();
"""

COUNT_TRIGGERS_DOWN = """
DROP TRIGGER IF EXISTS tb_results_usage_insert ON item_results;
DROP FUNCTION IF EXISTS tb_results_usage();
DROP TRIGGER IF EXISTS tb_items_counts_delete ON items;
DROP TRIGGER IF EXISTS tb_items_counts_update ON items;
DROP TRIGGER IF EXISTS tb_items_counts_insert ON items;
DROP FUNCTION IF EXISTS tb_items_counts();
"""


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "queued",
                "running",
                "completed",
                "failed",
                "cancelling",
                "cancelled",
                "expired",
                name="status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column("params", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("metadata", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("hinted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("total", sa.Integer(), server_default="0", nullable=False),
        sa.Column("pending", sa.Integer(), server_default="0", nullable=False),
        sa.Column("running", sa.Integer(), server_default="0", nullable=False),
        sa.Column("succeeded", sa.Integer(), server_default="0", nullable=False),
        sa.Column("failed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cancelled", sa.Integer(), server_default="0", nullable=False),
        sa.Column("expired", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    op.create_index(
        "ix_jobs_active",
        "jobs",
        ["status"],
        unique=False,
        postgresql_where=sa.text("status IN ('queued', 'running', 'cancelling')"),
    )
    op.create_index("ix_jobs_created_at_id", "jobs", ["created_at", "id"], unique=False)
    op.create_table(
        "workers",
        sa.Column("id", sa.String(length=128), nullable=False),
        sa.Column("hostname", sa.String(length=256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("model", sa.String(length=256), nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "heartbeat_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
    )
    op.create_table(
        "items",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(length=128), nullable=False),
        sa.Column("messages", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("prompt", sa.Text(), nullable=True),
        sa.Column("params", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "status",
            sa.Enum(
                "pending",
                "running",
                "succeeded",
                "failed",
                "cancelled",
                "expired",
                name="status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("crashes", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_owner", sa.String(length=128), nullable=True),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.CheckConstraint(
            "(messages IS NULL) <> (prompt IS NULL)", name=op.f("ck_items_one_input")
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_items_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_items")),
        sa.UniqueConstraint("job_id", "custom_id", name=op.f("uq_items_job_id_custom_id")),
        sa.UniqueConstraint("job_id", "seq", name=op.f("uq_items_job_id_seq")),
    )
    op.create_index(
        "ix_items_job_id_status_seq", "items", ["job_id", "status", "seq"], unique=False
    )
    op.create_index(
        "ix_items_running_lease",
        "items",
        ["lease_expires_at"],
        unique=False,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_table(
        "item_results",
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("thinking", sa.Text(), nullable=False),
        sa.Column("answer", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=False),
        sa.Column("thinking_truncated", sa.Boolean(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("reasoning_tokens", sa.Integer(), nullable=False),
        sa.Column("worker_id", sa.String(length=128), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["item_id"],
            ["items.id"],
            name=op.f("fk_item_results_item_id_items"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_item_results_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("item_id", name=op.f("pk_item_results")),
    )
    op.create_index(op.f("ix_item_results_job_id"), "item_results", ["job_id"], unique=False)
    op.execute(COUNT_TRIGGERS_UP)


def downgrade() -> None:
    op.execute(COUNT_TRIGGERS_DOWN)
    op.drop_index(op.f("ix_item_results_job_id"), table_name="item_results")
    op.drop_table("item_results")
    op.drop_index(
        "ix_items_running_lease", table_name="items", postgresql_where=sa.text("status = 'running'")
    )
    op.drop_index("ix_items_job_id_status_seq", table_name="items")
    op.drop_table("items")
    op.drop_table("workers")
    op.drop_index("ix_jobs_created_at_id", table_name="jobs")
    op.drop_index(
        "ix_jobs_active",
        table_name="jobs",
        postgresql_where=sa.text("status IN ('queued', 'running', 'cancelling')"),
    )
    op.drop_table("jobs")
