"""The benchmark's sampler of Postgres waits (bench/pg_waits.py) sees a transaction waiting on
another's row lock, and which statement it was."""

from __future__ import annotations

import threading
import time

import sqlalchemy as sa

from bench.pg_waits import PgWaits
from tests.helpers import seed_job
from thinkbatch.settings import Settings


def test_a_wait_on_a_row_lock_is_seen(db: sa.Engine, database_url: str, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=1)
    lock = sa.text("SELECT id FROM jobs WHERE id = :id FOR UPDATE")
    with PgWaits(database_url) as waits, db.connect() as holder:
        with holder.begin():
            holder.execute(lock, {"id": job_id})

            def wait_for_it() -> None:
                with db.begin() as conn:
                    conn.execute(lock, {"id": job_id})

            waiter = threading.Thread(target=wait_for_it)
            waiter.start()
            time.sleep(0.5)  # the waiter blocks on the holder's lock all this while
        waiter.join(10)
    assert waits.samples >= 10
    assert waits.share("waiting on a lock (transactionid)") > 0.5, waits.summary()
    [(query, _count)] = waits.locked.most_common(1)
    assert query.startswith("SELECT id FROM jobs WHERE id = $1 FOR UPDATE"[:40])
