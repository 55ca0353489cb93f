"""A job's crash suspects are found by an index of their own

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 15:00:00

`ix_items_pending_suspects`: the pending items that were in flight when an engine died
(`crashes > 0`). A worker whose claim comes back empty asks whether the job has suspects left,
and the probes for pending work of given models (an idle worker's adoption, the sweeper's
re-hints, a worker deciding whether to stay on a job) ask for them too. Without it each of
those read every pending item of the job, heap row by heap row: 3 to 8 ms for a job with
50,000 items of another model pending, once a second for each worker in a mixed job's tail.
Suspects are few, so the index costs an entry only when an engine dies with items in flight.

Built CONCURRENTLY, outside a transaction, as 0010's indexes: a plain CREATE INDEX would hold
off every write to `items` for a scan of the whole table while workers run.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_items_pending_suspects",
            "items",
            ["job_id", "crashes", "seq"],
            postgresql_where=sa.text("status = 'pending' AND crashes > 0"),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index("ix_items_pending_suspects", table_name="items", postgresql_concurrently=True)
