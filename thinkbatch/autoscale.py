"""What a fleet scales on: a served model's pending and running items, counted in Postgres.

Each model's workers scale with the work that waits for them or is under way (KEDA's PostgreSQL
trigger in deploy/k8s runs this query every polling interval). Postgres is the record of every
item; Redis holds hints that a restart may lose, so a count of queue messages could say "no work"
while items wait. Running items count too: a worker that holds items is never scaled away
mid-item for want of pending ones.

The SQL is written here and nowhere else: deploy/k8s carries the text this module renders,
verbatim, and tests/unit/test_k8s.py fails when the two differ (regenerate with
`python -m thinkbatch.autoscale MODEL [ADAPTER ...]`). An item belongs to the model it names,
or to its job's (jobs.model) when it names none.
"""

from __future__ import annotations

import sys

from thinkbatch.models import ItemStatus

COUNTED = (ItemStatus.pending, ItemStatus.running)


def sql_literal(text: str) -> str:
    """`text` as a standard SQL string literal (standard_conforming_strings, Postgres' default
    since 9.1: a backslash is an ordinary character, a quote is doubled)."""
    if "\x00" in text:
        raise ValueError("a model name cannot hold a NUL character")
    return "'" + text.replace("'", "''") + "'"


def pending_work_sql(model: str, *adapters: str) -> str:
    """One row, one number: the items of `model` (and of its `adapters`, which the same
    workers serve) that are pending or running.

    A KEDA trigger cannot bind parameters, so the names are literals in the text. An item's
    model is its own (`items.model`) or, when it names none, its job's. The jobs of a model are
    its whole history; `unfinished > 0` (the job row's count of its pending and running
    items, migration 0004) keeps the count to jobs with work left, each one index probe of its
    items (ix_items_job_id_status_seq) however many jobs have ended. A job past its window
    counts only its running items: its pending ones will never run, and a worker started for
    them would only expire them (the job's next read does that, JobService.get)."""
    statuses = ", ".join(sql_literal(status.value) for status in COUNTED)
    names = ", ".join(sql_literal(name) for name in (model, *adapters))
    return (
        "SELECT count(*) FROM items JOIN jobs ON jobs.id = items.job_id "  # noqa: S608 - quoted
        f"WHERE jobs.unfinished > 0 AND jobs.models ?| ARRAY[{names}] "
        f"AND coalesce(items.model, jobs.model) IN ({names}) "
        f"AND items.status IN ({statuses}) "
        "AND (items.status = 'running' OR jobs.expires_at > now())"
    )


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m thinkbatch.autoscale MODEL [ADAPTER ...]  (served names)")
    print(pending_work_sql(*sys.argv[1:]))
