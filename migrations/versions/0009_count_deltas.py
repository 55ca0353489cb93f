"""A worker's stores add to a job's counts in a row of their own, folded into the job's row later

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 09:00:00

Every store of a job ended with an UPDATE of the job's one row, whose lock it then held to its
commit, WAL flush included: with eight workers on one job (`make bench-fleet`), 94% of the
backends that waited on a lock waited there. Each worker now adds to its own row of
`job_count_deltas` (keyed by job and writer), which no other worker's store touches; the job's
row takes the sums when it is finalized, and on every pass of the sweeper
(thinkbatch/ledger/counts.py). A job's counts as read are its row plus its deltas.

Nothing to backfill: the table starts empty, and every job's row holds all of its counts. The
downgrade folds whatever deltas exist into their jobs' rows before it drops the table.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_FOLD_ALL = """
UPDATE jobs AS j SET
    unfinished = j.unfinished - (s.succeeded + s.failed + s.cancelled + s.expired),
    succeeded = j.succeeded + s.succeeded,
    failed = j.failed + s.failed,
    cancelled = j.cancelled + s.cancelled,
    expired = j.expired + s.expired,
    prompt_tokens = j.prompt_tokens + s.prompt_tokens,
    completion_tokens = j.completion_tokens + s.completion_tokens,
    reasoning_tokens = j.reasoning_tokens + s.reasoning_tokens
FROM (
    SELECT job_id, sum(succeeded) AS succeeded, sum(failed) AS failed,
           sum(cancelled) AS cancelled, sum(expired) AS expired,
           sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens,
           sum(reasoning_tokens) AS reasoning_tokens
    FROM job_count_deltas GROUP BY job_id
) AS s
WHERE j.id = s.job_id
"""


def upgrade() -> None:
    op.create_table(
        "job_count_deltas",
        sa.Column("job_id", sa.Uuid(), nullable=False),
        sa.Column("writer", sa.String(length=128), nullable=False),
        sa.Column("succeeded", sa.Integer(), server_default="0", nullable=False),
        sa.Column("failed", sa.Integer(), server_default="0", nullable=False),
        sa.Column("cancelled", sa.Integer(), server_default="0", nullable=False),
        sa.Column("expired", sa.Integer(), server_default="0", nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("reasoning_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_job_count_deltas_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "writer", name=op.f("pk_job_count_deltas")),
    )


def downgrade() -> None:
    op.execute("LOCK TABLE job_count_deltas IN EXCLUSIVE MODE")
    op.execute(_FOLD_ALL)
    op.drop_table("job_count_deltas")
