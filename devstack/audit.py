"""What a finished job's rows say about the exactly-once guarantee, counted the one way the
chaos and multi-host tiers and the benchmarks that kill or share workers report it."""

from __future__ import annotations

import uuid

import sqlalchemy as sa


def lost_and_duplicated(db: sa.Engine, job_id: str | uuid.UUID) -> tuple[int, int]:
    """(lost, duplicated) of a finished job: items not terminal or succeeded without a
    result; results beyond one per item."""
    with db.connect() as conn:
        lost = conn.execute(
            sa.text(
                "SELECT count(*) FROM items i LEFT JOIN item_results r ON r.item_id = i.id "
                "WHERE i.job_id = :id AND (i.status IN ('pending', 'running') "
                "OR (i.status = 'succeeded' AND r.item_id IS NULL))"
            ),
            {"id": job_id},
        ).scalar_one()
        duplicated = conn.execute(
            sa.text(
                "SELECT count(*) - count(DISTINCT i.custom_id) FROM item_results r "
                "JOIN items i ON i.id = r.item_id WHERE r.job_id = :id"
            ),
            {"id": job_id},
        ).scalar_one()
    return int(lost), int(duplicated)
