"""A worker's stores add to a job's counts in its own delta rows (ledger/counts.py): two workers
of one job never wait for each other's commits, every read adds the deltas, and the job is
finalized by whichever writer commits last, or by the sweeper."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa
from sqlalchemy import exc

from tests.helpers import TENANT
from tests.helpers import check_invariants
from tests.helpers import seed_job
from thinkbatch import ledger
from thinkbatch.jobs import JobService
from thinkbatch.jobs import quotas
from thinkbatch.keys import Caller
from thinkbatch.settings import Settings
from thinkbatch.sweeper import sweep


def _claim(db: sa.Engine, job_id: uuid.UUID, owner: str, n: int) -> list[ledger.Claimed]:
    with db.begin() as conn:
        return ledger.claim(conn, job_id, owner=owner, n=n, lease_s=60)


def _store(conn: sa.Connection, owner: str, items: list[ledger.Claimed], *, writer: bool) -> None:
    """A worker's store as the writer makes it (worker/runner/writer.py): results, then counts
    into the writer's own deltas (or, writer=False, into the job's row)."""
    counted = ledger.Counts()
    done = [ledger.Done(i.id, i.job_id, i.attempt, "t", "a", "stop", False, 3, 4, 1) for i in items]
    assert len(ledger.complete(conn, owner, done, counted)) == len(items)
    ledger.add_counts(conn, counted, writer=owner if writer else None)


def _deltas(db: sa.Engine, job_id: uuid.UUID) -> dict[str, int]:
    with db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT writer, succeeded FROM job_count_deltas WHERE job_id = :j"),
            {"j": job_id},
        ).all()
    return {row.writer: row.succeeded for row in rows}


def _status(db: sa.Engine, job_id: uuid.UUID) -> str:
    with db.connect() as conn:
        return str(
            conn.execute(sa.text("SELECT status FROM jobs WHERE id = :j"), {"j": job_id}).scalar()
        )


def _locked_out(conn: sa.Connection) -> None:
    conn.execute(sa.text("SET LOCAL lock_timeout = '1s'"))


def test_two_workers_of_one_job_store_without_waiting_for_each_other(
    db: sa.Engine, settings: Settings
) -> None:
    job_id = seed_job(db, settings, n=30)
    a, b, c = (_claim(db, job_id, owner, 10) for owner in ("w1", "w2", "w3"))
    with db.connect() as first:
        held = first.begin()
        _store(first, "w1", a, writer=True)  # not committed: its delta row stays locked
        with db.begin() as second:
            _locked_out(second)
            _store(second, "w2", b, writer=True)  # would raise if it waited for `first`
        held.rollback()
    # The job's row, by contrast, is what every store used to lock to its commit.
    with db.connect() as first:
        held = first.begin()
        _store(first, "w1", a, writer=False)
        with pytest.raises(exc.OperationalError, match="lock timeout"), db.begin() as third:
            _locked_out(third)
            _store(third, "w3", c, writer=False)
        held.rollback()
    assert _deltas(db, job_id) == {"w2": 10}


def test_the_later_of_two_last_stores_finalizes_the_job(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=20)
    a, b = _claim(db, job_id, "w1", 10), _claim(db, job_id, "w2", 10)
    with db.connect() as first, db.connect() as second:
        t1, t2 = first.begin(), second.begin()
        _store(first, "w1", a, writer=True)
        _store(second, "w2", b, writer=True)
        t1.commit()
        with db.begin() as conn:  # w1 asks while w2's store is still open: work is left
            assert ledger.finalize_if_done(conn, [job_id]) == 0
        assert _status(db, job_id) == "running"
        t2.commit()
    with db.begin() as conn:  # w2 asks after its commit and sees both
        assert ledger.finalize_if_done(conn, [job_id]) == 1
    assert _status(db, job_id) == "completed"
    assert _deltas(db, job_id) == {}  # finalizing folded them into the job's row
    counts = check_invariants(db, job_id)
    assert counts["succeeded"] == 20


def test_every_read_of_a_job_adds_its_deltas(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=12)
    with db.begin() as conn:  # live workers: the one item left running has a live lease
        conn.execute(
            sa.text(
                "INSERT INTO workers (id, hostname, pid, model) VALUES ('w1', 'h', 1, 'm'),"
                " ('w2', 'h', 2, 'm')"
            )
        )
    a, b = _claim(db, job_id, "w1", 5), _claim(db, job_id, "w2", 4)
    with db.begin() as conn:
        _store(conn, "w1", a, writer=True)
        _store(conn, "w2", b[:3], writer=True)
    assert _deltas(db, job_id) == {"w1": 5, "w2": 3}
    with db.connect() as conn:  # the job's row alone still holds them all unfinished
        row = conn.execute(
            sa.text("SELECT unfinished, succeeded FROM jobs WHERE id = :j"), {"j": job_id}
        ).one()
    assert tuple(row) == (12, 0)

    out = JobService(settings, db, celery=None).status(Caller(TENANT, None), job_id)
    assert out.counts.model_dump() == {
        "total": 12,
        "pending": 3,
        "running": 1,
        "succeeded": 8,
        "failed": 0,
        "cancelled": 0,
        "expired": 0,
    }
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (24, 32)
    with db.connect() as conn:
        state = ledger.job_state(conn, job_id)
        assert state is not None
        assert (state.pending, state.running, state.done) == (3, 1, 8)
        # The tenant's quota counts the 4 items left, not the 12 the row holds.
        with pytest.raises(quotas.QuotaExceeded, match="has 4 unfinished items"):
            quotas.check_unfinished_items(
                conn, TENANT, 7, settings.model_copy(update={"tenant_max_unfinished_items": 10})
            )
    check_invariants(db, job_id, finished=False)


def test_the_sweeper_folds_deltas_and_finalizes_what_no_writer_did(
    db: sa.Engine, settings: Settings
) -> None:
    job_id = seed_job(db, settings, n=6)
    other = seed_job(db, settings, n=6)
    with db.begin() as conn:  # a writer that stored the last items and died before asking
        _store(conn, "w1", _claim(db, job_id, "w1", 6), writer=True)
        _store(conn, "w1", _claim(db, other, "w1", 2), writer=True)
    sweep(db, settings, publish=lambda _: True)
    assert _deltas(db, job_id) == _deltas(db, other) == {}
    assert _status(db, job_id) == "completed"
    assert _status(db, other) == "running"
    with db.connect() as conn:
        row = conn.execute(
            sa.text("SELECT unfinished, succeeded, prompt_tokens FROM jobs WHERE id = :j"),
            {"j": other},
        ).one()
    assert tuple(row) == (4, 2, 6)
    check_invariants(db, job_id)
    check_invariants(db, other, finished=False)


def test_a_fold_leaves_the_delta_of_an_open_store_and_never_waits_for_it(
    db: sa.Engine, settings: Settings
) -> None:
    job_id = seed_job(db, settings, n=8)
    a, b = _claim(db, job_id, "w1", 4), _claim(db, job_id, "w2", 4)
    with db.begin() as conn:
        _store(conn, "w1", a, writer=True)
    with db.connect() as open_store:
        held = open_store.begin()
        _store(open_store, "w2", b, writer=True)
        with db.begin() as conn:
            _locked_out(conn)
            assert ledger.fold_counts(conn) == 1  # w1's delta, not w2's
            assert ledger.finalize_jobs(conn, [job_id]) == 0  # w2's items still count
        held.commit()
    assert _deltas(db, job_id) == {"w2": 4}
    with db.begin() as conn:
        assert ledger.finalize_if_done(conn, [job_id]) == 1
    assert _deltas(db, job_id) == {}
    assert check_invariants(db, job_id)["succeeded"] == 8


def test_a_deleted_job_takes_its_deltas_along(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=2)
    with db.begin() as conn:
        _store(conn, "w1", _claim(db, job_id, "w1", 2), writer=True)
        conn.execute(sa.text("DELETE FROM jobs WHERE id = :j"), {"j": job_id})
    assert _deltas(db, job_id) == {}
