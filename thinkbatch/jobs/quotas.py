"""Per-tenant quotas, checked inside the transaction that stores a job.

Both are read from Postgres, the system of record: several API processes see the same numbers,
and a restart of Redis or of the API resets nothing. The tenant's advisory lock
(ledger.lock_tenant, taken by the front door first) serializes that tenant's own submissions
(others are not affected), so parallel submits cannot each see room for themselves and together
overrun the quota.
"""

from __future__ import annotations

import math
import uuid
from datetime import UTC
from datetime import datetime
from datetime import timedelta

import sqlalchemy as sa

from thinkbatch.models import ACTIVE_JOB_STATUSES
from thinkbatch.models import Job
from thinkbatch.settings import Settings

RATE_WINDOW_S = 60
# There is no telling when a tenant's items will finish; this is how soon a retry is worth it.
ITEMS_RETRY_AFTER_S = 30


class QuotaExceeded(Exception):
    def __init__(self, message: str, *, retry_after: float, code: str = "quota_exceeded"):
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after = max(1, math.ceil(retry_after))


def check_submission_rate(conn: sa.Connection, tenant: str, settings: Settings) -> None:
    """At most TENANT_JOBS_PER_MINUTE jobs in any 60 s (a sliding window over jobs.created_at)."""
    limit = settings.tenant_jobs_per_minute
    since = datetime.now(UTC) - timedelta(seconds=RATE_WINDOW_S)
    recent = (
        sa.select(Job.created_at)
        .where(Job.tenant == tenant, Job.created_at > since)
        .order_by(Job.created_at.desc())
        .limit(limit)
        .subquery()
    )
    count, oldest = conn.execute(sa.select(sa.func.count(), sa.func.min(recent.c.created_at))).one()
    if count >= limit:
        retry = (oldest - since).total_seconds()
        raise QuotaExceeded(
            f"tenant {tenant!r} submitted {count} jobs in the last {RATE_WINDOW_S} s; the limit "
            f"is {limit} (TENANT_JOBS_PER_MINUTE)",
            retry_after=retry,
            code="rate_limit_exceeded",
        )


def check_unfinished_items(
    conn: sa.Connection,
    tenant: str,
    adding: int,
    settings: Settings,
    *,
    exclude: uuid.UUID | None = None,
) -> None:
    """The tenant's pending and running items across its live jobs (but `exclude`, the job
    being stored), plus the `adding` items of that job, must stay within
    TENANT_MAX_UNFINISHED_ITEMS."""
    limit = settings.tenant_max_unfinished_items
    query = sa.select(sa.func.coalesce(sa.func.sum(Job.unfinished), 0)).where(
        Job.tenant == tenant, Job.status.in_(ACTIVE_JOB_STATUSES)
    )
    if exclude is not None:
        query = query.where(Job.id != exclude)
    unfinished = int(conn.scalar(query) or 0)
    if unfinished + adding > limit:
        raise QuotaExceeded(
            f"tenant {tenant!r} has {unfinished} unfinished items and this job adds {adding}; "
            f"the quota is {limit} (TENANT_MAX_UNFINISHED_ITEMS)",
            retry_after=ITEMS_RETRY_AFTER_S,
        )
