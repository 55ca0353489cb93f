"""The probes for pending work of given models (a worker's empty claim asking for suspects, a
worker deciding whether to stay on a job, an idle worker looking for a job to adopt, the
sweeper's re-hints) read a few index pages, not every pending item of the job: in a mixed
job's tail the remaining work is all another model's, and the workers of the finished models
ask once a second each. Counted as the blocks Postgres fetched for `items` and its indexes,
past the point where a prepared statement's generic plan takes over."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy import orm

from tests.helpers import make_settings
from tests.helpers import submit_job
from thinkbatch import ledger
from thinkbatch.jobs import read
from thinkbatch.ledger import ModelFilter
from thinkbatch.models import Job
from thinkbatch.settings import Settings

BASE, ONE, TWO, REST = "thinkbatch-demo", "tiny-one", "tiny-two", "tiny-rest"
ITEMS = 6000
FEW = 20  # items of ONE, and as many of TWO; the rest are REST's
# The statement runs more often than psycopg's prepare threshold and Postgres's five custom
# plans, so the last calls run on the generic plan.
CALLS = 14
MOST_BLOCKS = 12  # per call; reading this job's pending items fetched 81 to 161

_BLOCKS = sa.text(
    "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid)) FROM pg_class AS c"
    " WHERE c.oid = 'items'::regclass"
    " OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'items'::regclass)"
)


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    return make_settings(database_url, redis_url, served_models=[BASE, ONE, TWO, REST])


@pytest.fixture
def job_id(db: sa.Engine, settings: Settings) -> uuid.UUID:
    """A job of three models whose ONE and TWO items are all claimed: what is left pending is
    REST's."""
    models = [ONE] * FEW + [TWO] * FEW + [REST] * (ITEMS - 2 * FEW)
    body = {"model": BASE, "items": [{"prompt": f"q{k}", "model": m} for k, m in enumerate(models)]}
    job = submit_job(db, settings, body)
    with db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(sa.text("ANALYZE items"))
    assert len(claim(db, job, [ONE])) == FEW
    assert len(claim(db, job, [TWO])) == FEW
    return job


def claim(db: sa.Engine, job: uuid.UUID, served: list[str], n: int = 100) -> list[ledger.Claimed]:
    models = of(db, job, served)
    with db.begin() as conn:
        got = ledger.claim(conn, job, owner="w-" + "-".join(served), n=n, lease_s=60, models=models)
    for item in got:  # the job's own model, named as the runner names it
        item.model = item.model or models.job_model
    return got


def of(db: sa.Engine, job: uuid.UUID, served: list[str]) -> ModelFilter:
    with db.connect() as conn:
        row = ledger.job_to_drive(conn, job)
    assert row is not None
    return ModelFilter.of(row.model, row.models, served)


def blocks_per_call(db: sa.Engine, probe: Callable[[sa.Connection], Any]) -> tuple[Any, float]:
    """The probe's answer and the blocks of `items` and its indexes its last calls fetched."""
    with db.begin() as conn:
        for _ in range(CALLS - 4):
            answer = probe(conn)
        before = conn.execute(_BLOCKS).scalar_one()
        for _ in range(4):
            assert probe(conn) == answer
        fetched = conn.execute(_BLOCKS).scalar_one() - before
    return answer, fetched / 4


def cheap_answers(
    db: sa.Engine, probes: dict[str, Callable[[sa.Connection], Any]]
) -> dict[str, Any]:
    """Each probe's answer, once every one of them is seen to fetch at most MOST_BLOCKS."""
    seen = {name: blocks_per_call(db, probe) for name, probe in probes.items()}
    assert {name: n for name, (_, n) in seen.items() if n > MOST_BLOCKS} == {}
    return {name: answer for name, (answer, _) in seen.items()}


def test_a_worker_whose_models_are_done_asks_cheaply(db: sa.Engine, job_id: uuid.UUID) -> None:
    one = of(db, job_id, [ONE])
    both = of(db, job_id, [ONE, TWO])
    assert (one.kind, both.kind) == ("named_one", "named")
    probes: dict[str, Callable[[sa.Connection], Any]] = {
        "has_pending one": lambda c: ledger.has_pending(c, job_id, one),
        "has_pending both": lambda c: ledger.has_pending(c, job_id, both),
        "has_suspects one": lambda c: ledger.has_suspects(c, job_id, one),
        "has_suspects both": lambda c: ledger.has_suspects(c, job_id, both),
        "job_to_adopt": lambda c: ledger.job_to_adopt(c, models=[ONE, TWO], exclude=[]),
        "stale_jobs": lambda c: ledger.stale_jobs(c, stale_s=0, models=[ONE, TWO]),
    }
    assert cheap_answers(db, probes) == {
        "has_pending one": False,
        "has_pending both": False,
        "has_suspects one": False,
        "has_suspects both": False,
        "job_to_adopt": None,
        "stale_jobs": [],
    }
    # The worker of what is left finds it, as cheaply.
    rest = of(db, job_id, [REST])
    answer, fetched = blocks_per_call(db, lambda c: ledger.has_pending(c, job_id, rest))
    assert answer is True and fetched <= MOST_BLOCKS


def test_suspects_are_found_by_the_workers_of_their_model(db: sa.Engine, job_id: uuid.UUID) -> None:
    with db.begin() as conn:
        released = ledger.release_crashed(
            conn, "w-" + ONE, max_attempts=3, code="engine_crash", message="engine died"
        )
    assert released == FEW
    one, two = of(db, job_id, [ONE]), of(db, job_id, [TWO])
    probes: dict[str, Callable[[sa.Connection], Any]] = {
        "has_suspects one": lambda c: ledger.has_suspects(c, job_id, one),
        "has_pending one": lambda c: ledger.has_pending(c, job_id, one),
        "has_suspects two": lambda c: ledger.has_suspects(c, job_id, two),
        "has_pending two": lambda c: ledger.has_pending(c, job_id, two),
        "job_to_adopt one": lambda c: ledger.job_to_adopt(c, models=[ONE], exclude=[]),
        "job_to_adopt two": lambda c: ledger.job_to_adopt(c, models=[TWO], exclude=[]),
    }
    assert cheap_answers(db, probes) == {
        "has_suspects one": True,
        "has_pending one": True,
        "has_suspects two": False,
        "has_pending two": False,
        "job_to_adopt one": job_id,
        "job_to_adopt two": None,
    }
    # And they are claimed as suspects, one group at a time.
    with db.begin() as conn:
        again = ledger.claim(conn, job_id, owner="w2", n=0, lease_s=60, suspects=True, models=one)
    assert 0 < len(again) < FEW and all(c.crashes == 1 for c in again)


def test_a_claim_shares_itself_between_the_served_names(db: sa.Engine, settings: Settings) -> None:
    """A worker serving some of a job's models takes an even share of each served name that
    has items (the job's own items, no model named, and those naming it are one name), each in
    claim order, and nothing of the others; what one name lacks comes from the others. One
    range of the pending index per name (tests/unit/test_prefix_order.py reads the plans)."""
    names = [None, ONE, TWO, REST] * 30 + [BASE] * 10  # the job's model, named by ten
    body = {
        "model": BASE,
        "items": [{"prompt": f"q{k}", **({"model": m} if m else {})} for k, m in enumerate(names)],
    }
    job = submit_job(db, settings, body)
    first = claim(db, job, [BASE, ONE], n=40)
    assert [c.model for c in first] == [BASE] * 20 + [ONE] * 20
    assert [c.seq for c in first[:20]] == [4 * k for k in range(20)]  # own ones, in order
    second = claim(db, job, [BASE, ONE], n=60)
    # BASE: its last 10 own ones, then the 10 naming it; ONE: its last 10; 30 short of 60.
    assert [c.model for c in second] == [BASE] * 20 + [ONE] * 10
    assert [c.seq for c in second[10:20]] == list(range(120, 130))
    assert claim(db, job, [BASE, ONE], n=100) == []
    two = claim(db, job, [TWO, REST], n=50)
    assert [c.model for c in two] == [REST] * 25 + [TWO] * 25  # names in the job's order
    assert [c.model for c in claim(db, job, [TWO, REST], n=50)] == [REST] * 5 + [TWO] * 5


def test_a_poll_asks_cheaply_which_models_a_job_waits_for(db: sa.Engine, job_id: uuid.UUID) -> None:
    """A status poll of a mixed job with no live worker names the models whose items are
    pending; each model's question is the workers' probe, not a read of the job's pending
    items (here 5,960 of REST's)."""
    with orm.Session(db) as session:
        job = session.get(Job, job_id)
        assert job is not None
        session.expunge(job)
    answer, fetched = blocks_per_call(db, lambda c: read.waiting_for(c, job, {}))
    assert answer == [REST]
    assert fetched <= 3 * MOST_BLOCKS  # three models asked
