"""Which job statuses count as runnable and as unfinished, and the same sets as SQL literals
for the statements of every module that filters jobs by status."""

from __future__ import annotations

from collections.abc import Iterable

from thinkbatch.models import ItemStatus
from thinkbatch.models import JobStatus

RUNNABLE = (JobStatus.queued.value, JobStatus.running.value)
# Jobs not yet in a final status: the ones finalize_jobs may move on.
UNFINISHED = (*RUNNABLE, JobStatus.cancelling.value)


def sql_in(statuses: Iterable[str]) -> str:
    """A set of job statuses as an SQL list of literals, made from the model's enums so that one
    definition serves every module. Literals rather than a bound array: the partial indexes
    (models.py) match only a query that names the same constants."""
    return "(" + ", ".join(f"'{JobStatus(s).value}'" for s in statuses) + ")"


def items_sql_in(statuses: Iterable[ItemStatus]) -> str:
    """A set of item statuses as an SQL list of literals, as `sql_in` for jobs."""
    return "(" + ", ".join(f"'{ItemStatus(s).value}'" for s in statuses) + ")"


# Items with work left: waiting for a worker or in one.
LIVE_ITEMS_SQL = items_sql_in((ItemStatus.pending, ItemStatus.running))
RUNNABLE_SQL = sql_in(RUNNABLE)
UNFINISHED_SQL = sql_in(UNFINISHED)
