"""Each item names the model it runs on; a job lists its models; workers record their adapters

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 21:00:00

- `items.model`: the served name (a base model or a LoRA adapter) an item runs on, NULL for
  its job's own model (`jobs.model`), so that a job of one model writes nothing more per item.
  A worker claims only items of the names it serves: a lost or misrouted hint can never run an
  item on the wrong model. Items stored before it are their job's model's.
- `jobs.models`: the job's distinct models, for the hints (one Celery queue per model) and to
  show which models a job waits for. Jobs stored before it have their one model.
- `ix_items_pending_model`: a claim's pending items of a named model, in order, however few
  among a mixed job's.
- `workers.adapters`: the LoRA adapters a worker serves beside its base model.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("items", sa.Column("model", sa.String(256), nullable=True))
    op.add_column(
        "jobs",
        sa.Column(
            "models",
            postgresql.JSONB(astext_type=sa.Text()),
            nullable=False,
            server_default=sa.text("'[]'::jsonb"),
        ),
    )
    op.execute("UPDATE jobs SET models = jsonb_build_array(model)")
    op.create_index(
        "ix_items_pending_model",
        "items",
        ["job_id", "model", "seq"],
        postgresql_where=sa.text("model IS NOT NULL AND status = 'pending' AND crashes = 0"),
    )
    op.add_column(
        "workers", sa.Column("adapters", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )


def downgrade() -> None:
    op.drop_column("workers", "adapters")
    op.drop_index("ix_items_pending_model", table_name="items")
    op.drop_column("jobs", "models")
    op.drop_column("items", "model")
