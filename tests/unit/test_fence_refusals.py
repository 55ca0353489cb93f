"""A worker's late writes, refused by the fence, are logged and counted: results, failures,
ends and releases of items whose leases passed on while the worker could not write (it was cut
off and judged dead, or too slow). Real Postgres; the writer's own transaction."""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client import REGISTRY

from tests.helpers import check_invariants
from tests.helpers import seed_job
from thinkbatch import ledger
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import Sampling
from thinkbatch.settings import Settings
from worker.engine import Generation
from worker.engine import Prepared
from worker.engine import ThinkTokens
from worker.runner.suspects import Suspects
from worker.runner.window import Flight
from worker.runner.window import InFlight
from worker.runner.window import JobHandle
from worker.runner.writer import AbortReason
from worker.runner.writer import Outcome
from worker.runner.writer import OutcomeKind
from worker.runner.writer import Refused
from worker.runner.writer import Writer
from worker.runner.writer import Writes
from worker.runner.writer import refused

KINDS = ("result", "failure", "end", "release")
SAMPLING = Sampling(16, 1.0, 1.0, -1, None, (), 0.0, 0.0, 1.0, True, False)


class _Engine:
    think = ThinkTokens(start_id=None, end_id=None, turn_start_id=None)


def fenced_metric() -> dict[str, float]:
    return {
        k: REGISTRY.get_sample_value("thinkbatch_worker_fenced_writes_total", {"kind": k}) or 0.0
        for k in KINDS
    }


def outcomes(items: list[Claimed], handle: JobHandle) -> list[Outcome]:
    """One outcome of each kind the writer stores: a result, a failure, an end, a release."""
    done, failed, ended, released = items
    prepared = Prepared(prompt_ids=[5], opened_in_prompt=False, sampling=SAMPLING)
    flight = Flight(claimed=done, prepared=prepared, handle=handle, started=0.0)
    generation = Generation(token_ids=[7, 8], text="an answer", finish_reason="stop",
                            prompt_tokens=1)  # fmt: skip
    return [
        Outcome(flight, done, handle, OutcomeKind.done, generation=generation),
        Outcome(None, failed, handle, OutcomeKind.error, code="engine_error", message="m"),
        Outcome(None, ended, handle, OutcomeKind.aborted, reason=AbortReason.expired),
        Outcome(None, released, handle, OutcomeKind.aborted, reason=AbortReason.shutdown),
    ]


def writer(settings: Settings, db: sa.Engine, owner: str) -> Writer:
    return Writer(
        settings,
        db,
        owner,
        _Engine(),
        InFlight(8),
        Suspects(),
        threading.Event(),  # type: ignore[arg-type]
    )


def handle_of(job_id: uuid.UUID) -> JobHandle:
    return JobHandle(job_id=job_id, weight=1, params={}, unsettled=4)


def register(db: sa.Engine, *owners: str) -> None:
    with db.begin() as conn:
        for owner in owners:
            ledger.register_worker(conn, owner, hostname="host", pid=1, model="m", dead_after_s=60)


def claim(db: sa.Engine, job_id: uuid.UUID, owner: str) -> list[Claimed]:
    with db.begin() as conn:
        return ledger.claim(conn, job_id, owner=owner, n=4, lease_s=60)


def test_refused_counts_what_each_fenced_write_did_not_apply() -> None:
    writes = Writes()
    writes.done = [object()] * 3  # type: ignore[list-item]
    writes.failed = [object()] * 2  # type: ignore[list-item]
    writes.ended = {k: [(1, uuid.uuid4(), 1)] * 2 for k in list(writes.ended)}  # 4 ends
    writes.released = [(1, uuid.uuid4(), 1)]
    applied: dict[str, Any] = {"done": {1}, "failed": {7: "pending"}, "ended": 1, "released": 1}
    assert refused(writes, applied) == Refused(results=2, failures=1, ends=3, releases=0)
    assert refused(writes, applied).total == 6
    assert refused(Writes(), {}) == Refused()


def test_late_writes_of_a_worker_judged_dead_are_refused_logged_and_counted(
    db: sa.Engine, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = seed_job(db, settings, n=4)
    register(db, "cut-off", "other")
    stale = claim(db, job_id, "cut-off")
    # The worker is cut off; the fleet judges it dead and releases its items, and another
    # worker claims them again.
    with db.begin() as conn:
        assert (
            ledger.release_crashed(
                conn, "cut-off", max_attempts=3, code="worker_lost", message="lost"
            )
            == 4
        )
    fresh = []
    for _ in range(2):  # as crash suspects, in halves
        with db.begin() as conn:
            fresh += ledger.claim(conn, job_id, owner="other", n=0, lease_s=60, suspects=True)
    assert {c.id for c in fresh} == {c.id for c in stale}
    before = fenced_metric()

    with caplog.at_level(logging.WARNING, logger="worker.runner.writer"):
        writer(settings, db, "cut-off").persist(outcomes(stale, handle_of(job_id)))

    (record,) = [r for r in caplog.records if "refused by the fence" in r.getMessage()]
    assert record.fenced == 4  # type: ignore[attr-defined]
    assert record.fenced_by_kind == dict.fromkeys(KINDS, 1)  # type: ignore[attr-defined]
    after = fenced_metric()
    assert {k: after[k] - before[k] for k in KINDS} == dict.fromkeys(KINDS, 1.0)
    with db.connect() as conn:  # nothing of the late writes landed: the items are the other's
        rows = conn.execute(
            sa.text("SELECT status, lease_owner FROM items WHERE job_id = :id"), {"id": job_id}
        ).all()
        results = conn.execute(sa.text("SELECT count(*) FROM item_results")).scalar_one()
    assert set(rows) == {("running", "other")} and results == 0
    check_invariants(db, job_id, finished=False)


def test_writes_within_the_lease_are_not_reported(
    db: sa.Engine, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = seed_job(db, settings, n=4)
    register(db, "holder")
    held = claim(db, job_id, "holder")
    before = fenced_metric()
    with caplog.at_level(logging.WARNING, logger="worker.runner.writer"):
        writer(settings, db, "holder").persist(outcomes(held, handle_of(job_id)))
    assert not [r for r in caplog.records if "refused by the fence" in r.getMessage()]
    assert fenced_metric() == before
    counts = check_invariants(db, job_id, finished=False)
    assert (counts["succeeded"], counts["expired"], counts["pending"]) == (1, 1, 2)
