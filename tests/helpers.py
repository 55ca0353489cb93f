"""Shared test helpers: seeding jobs and checking the invariants every scenario must keep."""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy import orm

from tests.conftest import TENANT
from thinkbatch import jobs as service
from thinkbatch.keys import Caller
from thinkbatch.schemas import JobCreate
from thinkbatch.settings import Settings


def seed_job(
    db: sa.Engine, settings: Settings, n: int = 5, *, tenant: str = TENANT, **fields: Any
) -> uuid.UUID:
    spec = JobCreate.model_validate(
        {"items": [{"custom_id": f"i{k}", "prompt": f"prompt {k}"} for k in range(n)], **fields}
    )
    with orm.Session(db) as session, session.begin():
        return service.create_job(session, Caller(tenant, None), spec, settings).id


def check_invariants(db: sa.Engine, job_id: uuid.UUID, *, finished: bool = True) -> dict[str, int]:
    """Every item terminal (if finished), one result per succeeded item and none for others,
    job counters equal to a count over the items, usage equal to a sum over results, no item
    running without a live lease."""
    with db.connect() as conn:
        job = conn.execute(sa.text("SELECT * FROM jobs WHERE id = :id"), {"id": job_id}).one()
        by_status = dict(
            conn.execute(
                sa.text("SELECT status, count(*) FROM items WHERE job_id = :id GROUP BY status"),
                {"id": job_id},
            ).all()
        )
        results = conn.execute(
            sa.text(
                "SELECT count(*) AS n, count(DISTINCT r.item_id) AS distinct_items,"
                " count(*) FILTER (WHERE i.status <> 'succeeded') AS orphans,"
                " coalesce(sum(r.prompt_tokens), 0) AS p,"
                " coalesce(sum(r.completion_tokens), 0) AS c,"
                " coalesce(sum(r.reasoning_tokens), 0) AS r"
                " FROM item_results r JOIN items i ON i.id = r.item_id WHERE r.job_id = :id"
            ),
            {"id": job_id},
        ).one()
        stale_running = conn.execute(
            sa.text(
                "SELECT count(*) FROM items i LEFT JOIN workers w ON w.id = i.lease_owner"
                " WHERE i.job_id = :id AND i.status = 'running'"
                " AND (i.lease_expires_at < now() OR w.stopped_at IS NOT NULL OR w.id IS NULL)"
            ),
            {"id": job_id},
        ).scalar()
    counts = {
        s: getattr(job, s)
        for s in ("pending", "running", "succeeded", "failed", "cancelled", "expired")
    }
    assert counts == {s: by_status.get(s, 0) for s in counts}, (counts, by_status)
    assert job.total == sum(by_status.values())
    assert results.n == results.distinct_items == by_status.get("succeeded", 0)
    assert results.orphans == 0
    assert (job.prompt_tokens, job.completion_tokens, job.reasoning_tokens) == (
        results.p,
        results.c,
        results.r,
    )
    assert stale_running == 0
    if finished:
        assert counts["pending"] == counts["running"] == 0, counts
        assert job.status in ("completed", "failed", "cancelled", "expired"), job.status
    return counts
