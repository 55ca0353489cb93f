"""A job counts its unfinished items in one column, so that a claim does not write the job row

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 00:30:00

A claim moves items from pending to running. While the job row counted both, every claim
updated that row and so waited for the writer's store of the same job to commit, and the other
way round: with the fake engine at step_s 0, a backend waited on the job row in 47 % of the
samples in which Postgres was working (README, Performance). Pending and running now count
together as `unfinished`, which a claim leaves as it is; the split between them is read from
the items when a job is shown (models.py, `Job.running`).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

# As in 0001, with `unfinished` for `pending` and `running`: a move between those two is no
# change of the job's counts, and the trigger then updates no job row at all (the last
# condition of its WHERE).
COUNTS_FUNCTION = """
CREATE OR REPLACE FUNCTION tb_items_counts() RETURNS trigger LANGUAGE plpgsql AS $$
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
            unfinished = j.unfinished + d.unfinished,
            succeeded = j.succeeded + d.succeeded,
            failed = j.failed + d.failed,
            cancelled = j.cancelled + d.cancelled,
            expired = j.expired + d.expired
        FROM (
            SELECT job_id,
                sum(n) AS total,
                coalesce(sum(n) FILTER (WHERE status IN ('pending', 'running')), 0)
                    AS unfinished,
                coalesce(sum(n) FILTER (WHERE status = 'succeeded'), 0) AS succeeded,
                coalesce(sum(n) FILTER (WHERE status = 'failed'), 0) AS failed,
                coalesce(sum(n) FILTER (WHERE status = 'cancelled'), 0) AS cancelled,
                coalesce(sum(n) FILTER (WHERE status = 'expired'), 0) AS expired
            FROM (%s) AS moves
            GROUP BY job_id
        ) AS d
        WHERE j.id = d.job_id
          AND (d.total, d.unfinished, d.succeeded, d.failed, d.cancelled, d.expired)
              <> (0, 0, 0, 0, 0, 0)
    $sql$, moves);
    RETURN NULL;
END
$$;
"""

COUNTS_FUNCTION_0001 = """
CREATE OR REPLACE FUNCTION tb_items_counts() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    moves text := CASE TG_OP
        WHEN 'INSERT' THEN 'SELECT job_id, status, 1 AS n FROM new_rows'
        WHEN 'DELETE' THEN 'SELECT job_id, status, -1 AS n FROM old_rows'
        ELSE 'SELECT job_id, status, 1 AS n FROM new_rows
              UNION ALL SELECT job_id, status, -1 AS n FROM old_rows'
    END;
BEGIN
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
"""


def upgrade() -> None:
    op.add_column(
        "jobs", sa.Column("unfinished", sa.Integer(), server_default="0", nullable=False)
    )
    op.execute("UPDATE jobs SET unfinished = pending + running")
    op.execute(COUNTS_FUNCTION)
    op.drop_column("jobs", "running")
    op.drop_column("jobs", "pending")


def downgrade() -> None:
    op.add_column("jobs", sa.Column("pending", sa.Integer(), server_default="0", nullable=False))
    op.add_column("jobs", sa.Column("running", sa.Integer(), server_default="0", nullable=False))
    op.execute(
        """
        UPDATE jobs AS j SET pending = c.pending, running = c.running
        FROM (
            SELECT job_id, count(*) FILTER (WHERE status = 'pending') AS pending,
                   count(*) FILTER (WHERE status = 'running') AS running
            FROM items GROUP BY job_id
        ) AS c
        WHERE c.job_id = j.id
        """
    )
    op.execute(COUNTS_FUNCTION_0001)
    op.drop_column("jobs", "unfinished")
