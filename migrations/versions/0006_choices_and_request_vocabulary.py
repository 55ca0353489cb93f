"""An item's result holds all its choices; a request's params keep their key order; a line of a
batch file refused for its body is stored as a failed item

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 20:00:00

- `item_results.choices`: every choice of an item that asked for more than one answer, for
  logprobs, tools or a JSON answer, in one row with the item's result, so that its choices are
  stored together, once. NULL for a plain item: its one choice is the row's own columns.
- `jobs.params` and `items.params` become `json`: `jsonb` sorts an object's keys, and the order
  of a schema's properties is the order the answer is written in.
- `items.error_param`: the field a refused line's error names (the OpenAI error file's `param`).
- `one_input` allows no input for a failed item: a line whose body could not be read has none.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "item_results", sa.Column("choices", postgresql.JSONB(astext_type=sa.Text()), nullable=True)
    )
    op.add_column("items", sa.Column("error_param", sa.String(256), nullable=True))
    for table in ("jobs", "items"):
        op.alter_column(
            table,
            "params",
            type_=sa.JSON(),
            existing_type=postgresql.JSONB(astext_type=sa.Text()),
            postgresql_using="params::json",
        )
    op.drop_constraint("one_input", "items", type_="check")
    op.create_check_constraint(
        "one_input",
        "items",
        "(messages IS NULL) <> (prompt IS NULL) "
        "OR (messages IS NULL AND prompt IS NULL AND status = 'failed')",
    )


def downgrade() -> None:
    op.execute("DELETE FROM items WHERE messages IS NULL AND prompt IS NULL")
    op.drop_constraint("one_input", "items", type_="check")
    op.create_check_constraint("one_input", "items", "(messages IS NULL) <> (prompt IS NULL)")
    for table in ("jobs", "items"):
        op.alter_column(
            table,
            "params",
            type_=postgresql.JSONB(astext_type=sa.Text()),
            existing_type=sa.JSON(),
            postgresql_using="params::jsonb",
        )
    op.drop_column("items", "error_param")
    op.drop_column("item_results", "choices")
