"""bench/ledger_apart.py measures real work in both arms: every item of the job is claimed once
and stored once, the apart arm's queue and leases end empty, a late second store is fenced
out, and the apart arm's item updates are HOT (the point of its design)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from bench import ledger_apart
from bench.ledger_alone import create
from bench.ledger_alone import done
from tests.helpers import seed_job
from thinkbatch.ledger.items import results_json
from thinkbatch.settings import Settings

N = 1_200  # three claims of 512, three stores of 500


@pytest.fixture
def apart(db: sa.Engine) -> Iterator[sa.Engine]:
    ledger_apart.make_schema(db)
    yield db
    ledger_apart.drop_schema(db)


def _scalar(db: sa.Engine, query: str, **params: object) -> object:
    with db.connect() as conn:
        return conn.execute(sa.text(query), params).scalar_one()


def test_the_apart_arm_claims_and_stores_each_item_once(
    apart: sa.Engine, settings: Settings
) -> None:
    job_id = create(apart, settings, N, 0)  # the benchmark's own job: its prompts, its rows
    ledger_apart.fill(apart, job_id)
    assert _scalar(apart, "SELECT count(*) FROM apart_pending") == N

    run = ledger_apart.run_arm(apart, job_id, "apart")

    assert set(run.per_item) == {"claims", "stores"}
    by_status = "SELECT count(*) FROM apart_items WHERE job_id = :j AND status = :s"
    assert _scalar(apart, by_status, j=job_id, s="succeeded") == N
    assert _scalar(apart, "SELECT count(DISTINCT item_id) FROM apart_results") == N
    assert _scalar(apart, "SELECT max(attempt) FROM apart_results") == 1
    assert _scalar(apart, "SELECT count(*) FROM apart_pending") == 0
    assert _scalar(apart, "SELECT count(*) FROM apart_leases") == 0
    # The ledger's items are untouched: the arm works on its own copy.
    assert _scalar(apart, "SELECT count(*) FROM items WHERE status <> 'pending'") == 0
    # A claim and a store update each row once each, and (almost) every update is HOT: no
    # index entry written. Where a page's old versions could not be pruned yet (an older
    # snapshot of another connection) the new one goes elsewhere.
    assert run.updates == 2 * N
    assert run.hot_share >= 0.95, run


def test_a_late_store_is_fenced_out(apart: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(apart, settings, n=10)
    ledger_apart.fill(apart, job_id)
    claim, store, _table = ledger_apart.ARMS["apart"]
    params = {"job_id": job_id, "owner": "bench", "lease_s": 600, "n": 512}
    with apart.begin() as conn:
        claimed = [(r.id, r.job_id, r.attempts) for r in conn.execute(claim, params)]
    assert len(claimed) == 10
    assert _scalar(apart, "SELECT count(*) FROM apart_leases") == 10
    rows = results_json([done(*c) for c in claimed])
    for expected in (10, 0):  # the second time the items are no longer running: nothing
        with apart.begin() as conn:
            assert len(conn.execute(store, {"owner": "bench", "rows": rows}).all()) == expected
    assert _scalar(apart, "SELECT count(*) FROM apart_results") == 10


def test_the_current_arm_runs_the_ledgers_own_statements(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=600)
    run = ledger_apart.run_arm(db, job_id, "current")
    assert (run.updates, run.hot) == (1200, 0)  # status is in the items' indexes: never HOT
    assert _scalar(db, "SELECT count(*) FROM items WHERE status = 'succeeded'") == 600
    assert _scalar(db, "SELECT count(*) FROM item_results") == 600
