"""Claims take a job's pending items in prefix order

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 18:00:00

- `items.prefix_key`: the item's claim key (thinkbatch/jobs/prefix.py), written at submit when
  CLAIM_ORDER is `prefix`: items whose prompts begin alike sort next to each other, so that
  one worker runs them close together and vLLM's prefix cache serves their shared beginning.
  NULL for refused items and for the items of jobs stored earlier: those are claimed last, in
  seq order.
- `ix_items_pending_prefix`, and `ix_items_pending_model` with the key: a claim's pending
  items in (prefix_key, seq) order. Both are partial on pending items, so a claim or a store
  (which move an item out of `pending`) adds no entry to either: they cost an entry at submit
  and at a release back to pending.

The indexes are built and the old one dropped CONCURRENTLY, outside a transaction: a plain
CREATE INDEX would hold off every write to `items` for a scan of the whole table, and a plain
DROP INDEX every read too, while the running workers and APIs go on during a rolling upgrade.
The new model index is built under a name of its own and renamed once the old one is gone.
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
    with op.get_context().autocommit_block():
        op.create_index(
            "ix_items_pending_prefix",
            "items",
            ["job_id", "prefix_key", "seq"],
            postgresql_where=sa.text(_PENDING),
            postgresql_concurrently=True,
        )
        _swap_model_index(["job_id", "model", "prefix_key", "seq"])


def downgrade() -> None:
    with op.get_context().autocommit_block():
        _swap_model_index(["job_id", "model", "seq"])
        op.drop_index(
            "ix_items_pending_prefix", table_name="items", postgresql_concurrently=True
        )
    op.drop_column("items", "prefix_key")


def _swap_model_index(columns: list[str]) -> None:
    """ix_items_pending_model on `columns`: built beside the old one, which is then dropped."""
    op.create_index(
        "ix_items_pending_model_next",
        "items",
        columns,
        postgresql_where=sa.text(f"model IS NOT NULL AND {_PENDING}"),
        postgresql_concurrently=True,
    )
    op.drop_index("ix_items_pending_model", table_name="items", postgresql_concurrently=True)
    op.execute("ALTER INDEX ix_items_pending_model_next RENAME TO ix_items_pending_model")
