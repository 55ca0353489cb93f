"""OpenAI Files and Batches: files, their chunks, and the batch columns of jobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("endpoint", sa.String(length=32), nullable=True))
    op.add_column("jobs", sa.Column("input_file_id", sa.Uuid(), nullable=True))
    op.add_column("jobs", sa.Column("completion_window_text", sa.String(length=16), nullable=True))
    op.add_column("jobs", sa.Column("idempotency_key", sa.String(length=255), nullable=True))
    op.add_column("jobs", sa.Column("cancelling_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column(
        "jobs", sa.Column("batch_errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column("jobs", sa.Column("output_file_id", sa.Uuid(), nullable=True))
    op.add_column("jobs", sa.Column("error_file_id", sa.Uuid(), nullable=True))
    op.add_column("jobs", sa.Column("output_expires_after_s", sa.Integer(), nullable=True))
    op.create_index(
        "ix_jobs_tenant_idempotency_key",
        "jobs",
        ["tenant", "idempotency_key"],
        unique=True,
        postgresql_where=sa.text("idempotency_key IS NOT NULL"),
    )
    op.create_index(
        "ix_jobs_batches",
        "jobs",
        ["tenant", "created_at", "id"],
        postgresql_where=sa.text("endpoint IS NOT NULL"),
    )
    op.create_table(
        "files",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column(
            "kind",
            sa.Enum("upload", "output", "error", name="kind", native_enum=False, length=16,
                    create_constraint=True),
            nullable=False,
        ),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("job_id", sa.Uuid(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_files_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_files")),
        sa.UniqueConstraint("job_id", "kind", name=op.f("uq_files_job_id_kind")),
    )
    op.create_index("ix_files_tenant_created_at_id", "files", ["tenant", "created_at", "id"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.Uuid(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"], ["files.id"], name=op.f("fk_file_chunks_file_id_files"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_chunks")),
    )
    # Chunks are written once and read in order; compression would only cost CPU on JSONL
    # that the caller already sized, so store them as they come.
    op.execute("ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.drop_table("file_chunks")
    op.drop_index("ix_files_tenant_created_at_id", table_name="files")
    op.drop_table("files")
    op.drop_index("ix_jobs_batches", table_name="jobs")
    op.drop_index("ix_jobs_tenant_idempotency_key", table_name="jobs")
    for column in (
        "output_expires_after_s", "error_file_id", "output_file_id", "batch_errors", "cancelling_at", "idempotency_key",
        "completion_window_text", "input_file_id", "endpoint",
    ):
        op.drop_column("jobs", column)
