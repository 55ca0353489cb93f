"""Claims take a job's pending items name by name, from one index

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-03 16:00:00

`ix_items_pending` (job_id, model, prefix_key, seq), partial on pending items not crashed,
replaces `ix_items_pending_prefix` (every pending item, in claim order) and
`ix_items_pending_model` (those naming a model). A claim now takes its items name by name, the
job's own items (a NULL model) being one range too, each name one range of the index in claim
order (thinkbatch/ledger/claims.py). A worker that serves some of a job's models read past the
others' pending items at every claim, or sorted all of its own; now it reads what it takes.
A pending item has one entry, as before for a job of one model; a mixed job's named items had
two.

Built CONCURRENTLY before the old ones are dropped CONCURRENTLY, outside a transaction, as in
0010: workers and APIs go on during a rolling upgrade. A worker of the previous version that
claims meanwhile still gets the right items, found by this index and sorted, until it is
replaced. Down again, the two old indexes are built back first.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_PENDING = "status = 'pending' AND crashes = 0"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_items_pending",
            "items",
            ["job_id", "model", "prefix_key", "seq"],
            postgresql_where=sa.text(_PENDING),
            postgresql_concurrently=True,
        )
        for name in ("ix_items_pending_prefix", "ix_items_pending_model"):
            op.drop_index(name, table_name="items", postgresql_concurrently=True)


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_items_pending_prefix",
            "items",
            ["job_id", "prefix_key", "seq"],
            postgresql_where=sa.text(_PENDING),
            postgresql_concurrently=True,
        )
        op.create_index(
            "ix_items_pending_model",
            "items",
            ["job_id", "model", "prefix_key", "seq"],
            postgresql_where=sa.text(f"model IS NOT NULL AND {_PENDING}"),
            postgresql_concurrently=True,
        )
        op.drop_index("ix_items_pending", table_name="items", postgresql_concurrently=True)
