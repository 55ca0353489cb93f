"""Claims take a job's pending items in prefix order

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 18:00:00

- `items.prefix_key`: the item's claim key (thinkbatch/jobs/prefix.py), written at submit when
  CLAIM_ORDER is `prefix`: items whose prompts begin alike sort next to each other, so that
  one worker runs them close together and vLLM's prefix cache serves their shared beginning.
  NULL for refused items and for every item stored before it: those are claimed last, in seq
  order, which is the order they were claimed in before.
- `ix_items_pending_prefix`, and `ix_items_pending_model` with the key: a claim's pending
  items in (prefix_key, seq) order. Both are partial on pending items, so a claim or a store
  (which move an item out of `pending`) adds no entry to either: they cost an entry at submit
  and at a release back to pending.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_PENDING = "status = 'pending' AND crashes = 0"


def upgrade() -> None:
    op.add_column("items", sa.Column("prefix_key", sa.LargeBinary(), nullable=True))
    op.create_index(
        "ix_items_pending_prefix",
        "items",
        ["job_id", "prefix_key", "seq"],
        postgresql_where=sa.text(_PENDING),
    )
    op.drop_index("ix_items_pending_model", table_name="items")
    op.create_index(
        "ix_items_pending_model",
        "items",
        ["job_id", "model", "prefix_key", "seq"],
        postgresql_where=sa.text(f"model IS NOT NULL AND {_PENDING}"),
    )


def downgrade() -> None:
    op.drop_index("ix_items_pending_model", table_name="items")
    op.create_index(
        "ix_items_pending_model",
        "items",
        ["job_id", "model", "seq"],
        postgresql_where=sa.text(f"model IS NOT NULL AND {_PENDING}"),
    )
    op.drop_index("ix_items_pending_prefix", table_name="items")
    op.drop_column("items", "prefix_key")
