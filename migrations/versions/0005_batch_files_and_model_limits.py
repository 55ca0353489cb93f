"""A batch's output files are made when it finishes; metadata is kept as sent; workers record
what the API needs to refuse an item that cannot fit their model; a job keeps the digest of the
request its idempotency key made it from

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 16:00:00

- `jobs.metadata` may be NULL: a request without metadata and one with `{}` are told apart.
- `ix_jobs_batches_unfiled` finds the finished batches whose output and error files are still
  to be made (by the worker that finished them, or the sweeper), so that reading a batch never
  writes. Batches finished before this revision are picked up by the next sweep.
- `workers.max_model_len`, `token_bytes_max` and `message_tokens_min`: the bound on an item's
  tokens that the API checks at submit.
- `jobs.request_digest`: a retried submission with the same Idempotency-Key gets its job back
  only if it is the same request. Jobs made before it have none, and a retry of theirs is
  taken as the same request.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.alter_column("jobs", "metadata", nullable=True)
    op.create_index(
        "ix_jobs_batches_unfiled",
        "jobs",
        ["finished_at"],
        postgresql_where=sa.text(
            "endpoint IS NOT NULL AND output_file_id IS NULL AND batch_errors IS NULL "
            "AND status IN ('completed', 'failed', 'cancelled', 'expired')"
        ),
    )
    for column in ("max_model_len", "token_bytes_max", "message_tokens_min"):
        op.add_column("workers", sa.Column(column, sa.Integer(), nullable=True))
    op.add_column("jobs", sa.Column("request_digest", sa.LargeBinary(32), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "request_digest")
    for column in ("message_tokens_min", "token_bytes_max", "max_model_len"):
        op.drop_column("workers", column)
    op.drop_index("ix_jobs_batches_unfiled", table_name="jobs")
    op.execute("UPDATE jobs SET metadata = '{}' WHERE metadata IS NULL")
    op.alter_column("jobs", "metadata", nullable=False)
