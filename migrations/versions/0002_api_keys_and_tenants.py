"""API keys, and the tenant that owns each job

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30 11:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.LargeBinary(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("prefix", name=op.f("uq_api_keys_prefix")),
    )
    # Jobs made before tenants existed belong to the tenant of unauthenticated use.
    op.add_column(
        "jobs",
        sa.Column("tenant", sa.String(length=64), server_default="default", nullable=False),
    )
    op.create_index("ix_jobs_tenant_created_at_id", "jobs", ["tenant", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_jobs_tenant_created_at_id", table_name="jobs")
    op.drop_column("jobs", "tenant")
    op.drop_table("api_keys")
