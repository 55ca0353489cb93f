"""The reads a poller makes many times a second keep one plan per connection.

A server-side prepared statement is planned again on every execution while Postgres judges
its generic plan (the one made without the parameters' values) dearer than the plans made for
each call's values. A constant sent as a parameter does that: `items.status = $5` is costed at
the average share of a status, a sixth of the job, where `items.status = 'running'` is costed
from the statistics at the few running items. The job's record (read.job_record, every status
call) then paid some 300 us of Postgres CPU an execution for planning, against 15 us to run.
"""

from __future__ import annotations

import uuid
from typing import Any

import sqlalchemy as sa

from tests.helpers import TENANT
from tests.helpers import seed_job
from thinkbatch.db import Prepared
from thinkbatch.db import make_engine
from thinkbatch.jobs import read
from thinkbatch.jobs.service import JobService
from thinkbatch.keys import Caller
from thinkbatch.models import Job
from thinkbatch.settings import Settings

EXECUTIONS = 12
# Postgres plans the first five executions for their values before it weighs a generic plan.
CUSTOM_FIRST = 5


def _plans(conn: sa.Connection, sql: str) -> tuple[int, int]:
    """(generic, custom) plans made so far for `sql` prepared on this connection."""
    rows = conn.exec_driver_sql(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements"
    ).all()
    # psycopg numbers the placeholders ($1, ...): the text up to the first one is the same.
    head = sql.partition("%(")[0].strip()
    found = [(g, c) for statement, g, c in rows if statement.strip().startswith(head)]
    assert len(found) == 1, [r[0][:80] for r in rows]
    return found[0]


def _running_job(db: sa.Engine, settings: Settings) -> uuid.UUID:
    """A job of 3,000 items, 20 of them running, the rest settled: the statistics of a job
    underway, where a status is far from a sixth of the items."""
    job_id = seed_job(db, settings, 3000)
    with db.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE items SET status = CASE WHEN seq % 150 = 0 THEN 'running' "
                "ELSE 'succeeded' END WHERE job_id = :j"
            ),
            {"j": job_id},
        )
        conn.execute(
            sa.text("UPDATE jobs SET unfinished = 20, succeeded = 2980 WHERE id = :j"),
            {"j": job_id},
        )
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("ANALYZE items")
    return job_id


def _run(db: sa.Engine, statement: Prepared, **params: Any) -> tuple[int, int]:
    """The plans of EXECUTIONS executions on a connection of its own: one from the tests' pool
    may hold the statement prepared, and planned, by an earlier test."""
    fresh = sa.create_engine(db.url, poolclass=sa.pool.NullPool)
    try:
        with fresh.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            for _ in range(EXECUTIONS):
                statement.all(conn, **params)
            return _plans(conn, statement.sql)
    finally:
        fresh.dispose()


def test_a_jobs_record_is_planned_once_per_connection(db: sa.Engine, settings: Settings) -> None:
    job_id = _running_job(db, settings)
    generic, custom = _run(db, read._RECORD, job_id=job_id, tenant=TENANT)
    assert (generic, custom) == (EXECUTIONS - CUSTOM_FIRST, CUSTOM_FIRST)
    # And it reads what it read: 20 running, none pending.
    with db.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        record = read.job_record(conn, Caller(TENANT, None), job_id)
    assert (record.running, record.pending, record.total) == (20, 0, 3000)


def test_every_count_of_a_job_is_costed_from_the_statistics(
    db: sa.Engine, settings: Settings
) -> None:
    """The class, not one statement: any read of a job's counts (Job's column properties, as
    the ORM reads a job and as the job listing does) carries no constant as a parameter."""
    job_id = _running_job(db, settings)
    counts = Prepared(
        sa.select(Job.unfinished, Job.running, Job.pending, Job.succeeded).where(
            Job.id == sa.bindparam("job_id")
        )
    )
    assert set(counts.defaults) == {"job_id"}, counts.defaults
    generic, custom = _run(db, counts, job_id=job_id)
    assert (generic, custom) == (EXECUTIONS - CUSTOM_FIRST, CUSTOM_FIRST)


def test_no_read_of_the_job_service_drops_the_polls_prepared_statements(
    db: sa.Engine, settings: Settings
) -> None:
    """psycopg drops every prepared statement of a connection when a transaction on it rolls
    back, and Postgres then plans the next five executions of each for their values. Every read
    the API serves shares the pool with the status calls: none may end in a rollback. A pool
    of one connection, tested by a round trip at every checkout (thinkbatch.db.ping): the
    status call's statement is prepared once and lives through them all."""
    job_id = _running_job(db, settings)
    settings = settings.model_copy(update={"db_ping_after_idle_s": 0})
    engine = make_engine(settings, pool_size=1, max_overflow=0)
    service = JobService(settings, engine, celery=None)
    caller = Caller(TENANT, None)
    polls = 0
    try:
        for read_ in (
            lambda: service.get(caller, job_id),
            lambda: service.list_jobs(caller, after=None, limit=10),
            lambda: service.page(caller, after=None, limit=10),
            lambda: service.items(caller, job_id, after="i5", limit=10),
            lambda: b"".join(service.results(caller, job_id)),
            lambda: service.finished_times(caller, job_id),
            lambda: service.waiting_for(service.get(caller, job_id)),
            service.fleet,
            service.models_view,
        ):
            service.status(caller, job_id)
            polls += 1
            read_()
        service.status(caller, job_id)
        polls += 1
        with service.reads.connect() as conn:
            generic, custom = _plans(conn, read._RECORD.sql)
            conn.exec_driver_sql("DEALLOCATE ALL")
    finally:
        engine.dispose()
    # The items page and the download check the job's owner by the same statement.
    executions = polls + 2
    assert (custom, generic) == (CUSTOM_FIRST, executions - CUSTOM_FIRST)
