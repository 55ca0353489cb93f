"""Item state transitions against real Postgres: fenced writes, counts, and the sweeper."""

from __future__ import annotations

import threading
import uuid

import pytest
import sqlalchemy as sa

from tests.helpers import check_invariants
from tests.helpers import seed_job
from thinkbatch import ledger
from thinkbatch.settings import Settings
from thinkbatch.sweeper import SWEEP_LOCK_KEY
from thinkbatch.sweeper import sweep


def done_for(item: ledger.Claimed, text: str = "answer") -> ledger.Done:
    return ledger.Done(item.id, item.job_id, item.attempt, "", text, "stop", False, 3, 4, 0)


def claim(db: sa.Engine, job_id: uuid.UUID, owner: str, n: int = 10) -> list[ledger.Claimed]:
    with db.begin() as conn:
        return ledger.claim(conn, job_id, owner=owner, n=n, lease_s=60)


def register(db: sa.Engine, *owners: str, stopped: bool = False, model: str = "m") -> None:
    with db.begin() as conn:
        for owner in owners:
            conn.execute(
                sa.text(
                    "INSERT INTO workers (id, hostname, pid, model, stopped_at) "
                    "VALUES (:id, 'h', 1, :model, CASE WHEN :s THEN now() END)"
                ),
                {"id": owner, "s": stopped, "model": model},
            )


def test_claims_never_overlap_and_complete_is_fenced(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=10)
    register(db, "w1", "w2")
    a = claim(db, job_id, "w1", 6)
    b = claim(db, job_id, "w2", 6)
    assert len(a) == 6 and len(b) == 4
    assert not {i.id for i in a} & {i.id for i in b}
    assert [i.seq for i in a] == list(range(6))
    with db.begin() as conn:
        assert ledger.complete(conn, "w1", [done_for(i) for i in a]) == {i.id for i in a}
        # A duplicate delivery of the same results, and a stranger's results, change nothing.
        assert ledger.complete(conn, "w1", [done_for(i, "dup") for i in a]) == set()
        assert ledger.complete(conn, "w1", [done_for(i) for i in b]) == set()
        assert ledger.complete(conn, "w2", [done_for(i) for i in b]) == {i.id for i in b}
        ledger.finalize_jobs(conn, [job_id])
    counts = check_invariants(db, job_id)
    assert counts["succeeded"] == 10
    with db.connect() as conn:
        answers = conn.execute(sa.text("SELECT DISTINCT answer FROM item_results")).scalars()
        assert set(answers) == {"answer"}


def test_complete_stores_the_text_as_generated(db: sa.Engine, settings: Settings) -> None:
    """The batch travels as one JSON document: every character survives it (NUL, which
    Postgres text cannot hold, is dropped), and so do the counts and the flag."""
    job_id = seed_job(db, settings, n=2)
    register(db, "w1")
    items = claim(db, job_id, "w1", 2)
    thinking = 'quotes " \\ back\\slash, tab\t, new\nline, \u00e9\u4e2d\U0001f600 and a NUL \x00.'
    answer = "\x01 control, </think> and {json: [1]}"
    done = [
        ledger.Done(i.id, i.job_id, i.attempt, thinking, answer, "length", True, 5, 7, 2)
        for i in items
    ]
    with db.begin() as conn:
        assert ledger.complete(conn, "w1", done) == {i.id for i in items}
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT thinking, answer, finish_reason, thinking_truncated, prompt_tokens,"
                " completion_tokens, reasoning_tokens, attempt, worker_id FROM item_results"
            )
        ).all()
    assert [tuple(r) for r in rows] == [
        (thinking.replace("\x00", ""), answer, "length", True, 5, 7, 2, 1, "w1")
    ] * 2


def test_concurrent_claims_from_many_threads(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=300)
    owners = [f"w{k}" for k in range(6)]
    register(db, *owners)
    got: dict[str, list[int]] = {}

    def run(owner: str) -> None:
        ids: list[int] = []
        while batch := claim(db, job_id, owner, 7):
            ids += [i.id for i in batch]
        got[owner] = ids

    threads = [threading.Thread(target=run, args=(o,)) for o in owners]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for ids in got.values() for i in ids]
    assert len(every) == len(set(every)) == 300
    check_invariants(db, job_id, finished=False)


def test_a_superseded_attempt_cannot_write(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=1)
    register(db, "w1")
    (first,) = claim(db, job_id, "w1")
    with db.begin() as conn:  # the lease lapses and the item is retried
        conn.execute(sa.text("UPDATE items SET lease_expires_at = now() - interval '1 s'"))
    sweep(db, settings, publish=lambda _: True)
    (second,) = claim(db, job_id, "w1")
    assert second.attempt == first.attempt + 1
    with db.begin() as conn:
        assert ledger.complete(conn, "w1", [done_for(first, "late")]) == set()
        assert ledger.complete(conn, "w1", [done_for(second)]) == {second.id}


def test_failures_retry_until_the_cap(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=1)
    register(db, "w1")
    for attempt in range(1, settings.max_attempts + 1):
        (item,) = claim(db, job_id, "w1")
        assert item.attempt == attempt
        with db.begin() as conn:
            status = ledger.fail(
                conn,
                "w1",
                [ledger.Failed(item.id, job_id, item.attempt, "engine_error", "boom", True)],
                max_attempts=settings.max_attempts,
            )
        assert status == {item.id: "failed" if attempt == settings.max_attempts else "pending"}
    with db.begin() as conn:
        ledger.finalize_jobs(conn, [job_id])
    assert check_invariants(db, job_id)["failed"] == 1


def test_non_retryable_failure_is_final(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=1)
    register(db, "w1")
    (item,) = claim(db, job_id, "w1")
    with db.begin() as conn:
        ledger.fail(
            conn,
            "w1",
            [ledger.Failed(item.id, job_id, item.attempt, "prompt_too_long", "long", False)],
            max_attempts=3,
        )
        ledger.finalize_jobs(conn, [job_id])
    assert check_invariants(db, job_id)["failed"] == 1


def test_sweeper_transitions(db: sa.Engine, settings: Settings) -> None:
    """Seed rows in every state the sweeper judges and check each transition (River-style)."""
    register(db, "alive", model=settings.model_name)  # a live worker of the job's model
    register(db, "dead", stopped=True)
    job_id = seed_job(db, settings, n=6)
    alive = claim(db, job_id, "alive", 3)  # 0..2
    claim(db, job_id, "dead", 2)  # 3..4; item 5 stays pending
    with db.begin() as conn:
        conn.execute(  # one of the live worker's leases lapsed
            sa.text("UPDATE items SET lease_expires_at = now() - interval '1 s' WHERE id = :id"),
            {"id": alive[0].id},
        )
        conn.execute(sa.text("UPDATE jobs SET hinted_at = NULL"))
    published: list[uuid.UUID] = []
    report = sweep(db, settings, publish=lambda j: published.append(j) or True)
    assert report.ran
    with db.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT seq, status FROM items")).all())
        crashes = dict(conn.execute(sa.text("SELECT seq, crashes FROM items")).all())
        attempts = dict(conn.execute(sa.text("SELECT seq, attempts FROM items")).all())
    assert rows == {
        0: "pending",
        1: "running",
        2: "running",
        3: "pending",
        4: "pending",
        5: "pending",
    }
    # The dead worker held two items: both become suspects, neither is charged the attempt.
    assert (crashes[3], crashes[4], attempts[3], attempts[4]) == (1, 1, 0, 0)
    # The lapsed lease of a live worker is a plain retry: the attempt stays counted.
    assert (crashes[0], attempts[0]) == (0, 1)
    assert published == [job_id]
    check_invariants(db, job_id, finished=False)
    # A second pass with fresh hints changes nothing.
    again = sweep(db, settings, publish=lambda j: published.append(j) or True)
    assert again.released == 0 and published == [job_id]


def test_sweeper_runs_once_at_a_time(db: sa.Engine, settings: Settings) -> None:
    with db.connect() as holder:
        holder.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": SWEEP_LOCK_KEY})
        assert not sweep(db, settings, publish=lambda _: True).ran
        holder.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": SWEEP_LOCK_KEY})
    assert sweep(db, settings, publish=lambda _: True).ran


def test_a_lone_crash_counts_and_fails_at_the_cap(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=1)
    register(db, "w1")
    for attempt in range(1, settings.max_attempts + 1):
        assert claim(db, job_id, "w1", 1)
        with db.begin() as conn:
            ledger.release_crashed(conn, "w1", max_attempts=3, code="engine_crash", message="x")
        with db.connect() as conn:  # a suspect is only claimable as a suspect
            assert ledger.has_suspects(conn, job_id) == (attempt < settings.max_attempts)
            assert claim(db, job_id, "w1", 1) == []
        with db.begin() as conn:
            conn.execute(sa.text("UPDATE items SET crashes = 0 WHERE status = 'pending'"))
    with db.begin() as conn:
        ledger.finalize_jobs(conn, [job_id])
    with db.connect() as conn:
        row = conn.execute(sa.text("SELECT status, attempts, error_code FROM items")).one()
    assert tuple(row) == ("failed", 3, "engine_crash")
    check_invariants(db, job_id)


def test_suspects_are_claimed_in_halves(db: sa.Engine, settings: Settings) -> None:
    job_id = seed_job(db, settings, n=9)
    register(db, "w1")
    claim(db, job_id, "w1", 8)
    with db.begin() as conn:
        ledger.release_crashed(conn, "w1", max_attempts=3, code="engine_crash", message="x")
    assert [i.seq for i in claim(db, job_id, "w1", 10)] == [8]  # normal items first
    with db.begin() as conn:
        group = ledger.claim(conn, job_id, owner="w1", n=0, lease_s=60, suspects=True)
    assert [i.seq for i in group] == [0, 1, 2, 3]
    with db.begin() as conn:  # the first half succeeds: the second half runs whole
        ledger.complete(conn, "w1", [done_for(i) for i in group])
        rest = ledger.claim(conn, job_id, owner="w1", n=0, lease_s=60, suspects=True)
    assert [i.seq for i in rest] == [4, 5, 6, 7]
    with db.begin() as conn:  # it crashes: that half is the next tier, halved again
        ledger.release_crashed(conn, "w1", max_attempts=3, code="engine_crash", message="x")
        nxt = ledger.claim(conn, job_id, owner="w1", n=0, lease_s=60, suspects=True)
    assert [(i.seq, i.crashes) for i in nxt] == [(4, 2), (5, 2)]


def test_a_retryable_failure_in_a_cancelling_job_ends_the_item(
    db: sa.Engine, settings: Settings
) -> None:
    """Nobody claims for a cancelling job: an item sent back to pending would keep the job
    `cancelling` for good. It fails instead, and the job ends cancelled."""
    job_id = seed_job(db, settings, n=3)
    register(db, "w1")
    items = claim(db, job_id, "w1", 3)
    with db.begin() as conn:
        assert ledger.cancel_job(conn, job_id) == (True, "cancelling")
        failed = [
            ledger.Failed(i.id, i.job_id, i.attempt, "engine_error", "boom", retryable=True)
            for i in items
        ]
        assert set(ledger.fail(conn, "w1", failed, max_attempts=3).values()) == {"failed"}
        ledger.finalize_jobs(conn, [job_id])
    counts = check_invariants(db, job_id)
    assert counts["failed"] == 3
    with db.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id})
        assert status.scalar_one() == "cancelled"


def test_the_sweeper_removes_expired_files_bytes(db: sa.Engine, settings: Settings) -> None:
    with db.begin() as conn:
        conn.execute(sa.text("TRUNCATE files CASCADE"))
        expiries = {
            "old": "now() - interval '1 second'",
            "new": "now() + interval '1 hour'",
            "forever": "NULL",
        }
        for name, expires in expiries.items():
            conn.execute(
                # Not an injection (S608): `expires` is one of the three literals above.
                sa.text(
                    "INSERT INTO files (id, tenant, kind, purpose, filename, bytes, created_at,"  # noqa: S608
                    " expires_at) VALUES (:id, 'acme', 'upload', 'batch', :name, 3, now(),"
                    f" {expires})"
                ),
                {"id": uuid.uuid5(uuid.NAMESPACE_DNS, name), "name": name},
            )
            conn.execute(
                sa.text("INSERT INTO file_chunks (file_id, seq, data) VALUES (:id, 0, 'abc')"),
                {"id": uuid.uuid5(uuid.NAMESPACE_DNS, name)},
            )
    report = sweep(db, settings, publish=lambda job_id: True)
    assert report.files_expired == 1
    with db.connect() as conn:
        left = dict(
            conn.execute(
                sa.text(
                    "SELECT f.filename, count(c.seq) FROM files f"
                    " LEFT JOIN file_chunks c ON c.file_id = f.id"
                    " WHERE f.deleted_at IS NULL GROUP BY f.filename"
                )
            ).all()
        )
    assert left == {"new": 1, "forever": 1}
    assert sweep(db, settings, publish=lambda job_id: True).files_expired == 0


def test_hints_are_stamped_with_the_database_clock(db: sa.Engine, settings: Settings) -> None:
    """The sweeper judges hinted_at against the database's now(): the API, the sweeper and the
    worker all stamp it with that clock, not their host's."""
    from thinkbatch.ledger import mark_hinted

    job_id = seed_job(db, settings, n=1)
    with db.begin() as conn:
        conn.execute(sa.text("SELECT pg_sleep(0.02)"))  # the host's clock moves on; now() not
        mark_hinted(conn, job_id)
        same = conn.execute(
            sa.text("SELECT hinted_at = now() FROM jobs WHERE id = :id"), {"id": job_id}
        ).scalar_one()
    assert same


def test_a_heartbeat_skips_a_job_row_a_store_holds(db: sa.Engine, settings: Settings) -> None:
    """A task's heartbeat on a job whose row a store holds (adding its counts, until its
    commit) skips the beat rather than queueing behind it; on a free row it stamps hinted_at."""
    job_id = seed_job(db, settings, n=2)
    items = claim(db, job_id, "w1", 2)

    def beat() -> bool:
        with db.begin() as conn:
            conn.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))  # a wait would raise
            ledger.mark_hinted(conn, job_id, unless_busy=True)
            return bool(
                conn.execute(
                    sa.text("SELECT hinted_at IS NOT DISTINCT FROM now() FROM jobs WHERE id = :id"),
                    {"id": job_id},
                ).scalar_one()
            )

    with db.connect() as store:
        store.begin()
        assert len(ledger.complete(store, "w1", [done_for(c) for c in items])) == 2
        assert not beat()
        store.commit()
    assert beat()
    with db.begin() as conn:
        ledger.finalize_jobs(conn, [job_id])
    assert check_invariants(db, job_id)["succeeded"] == 2


def test_writers_ending_items_of_the_same_jobs_crosswise_do_not_deadlock(
    db: sa.Engine, settings: Settings
) -> None:
    """Two workers each store results of one job and failures of the other, crosswise: each
    write only gathers its counts, and the batch adds them at once, its jobs in id order (as
    the writer does). Added write by write, the second write of each would wait for the
    other's first: a deadlock, which Postgres breaks by aborting one of them."""
    a, b = sorted([seed_job(db, settings, n=2), seed_job(db, settings, n=2)])
    held = {owner: {job: claim(db, job, owner, 1)[0] for job in (a, b)} for owner in ("w1", "w2")}

    def failure(item: ledger.Claimed) -> ledger.Failed:
        return ledger.Failed(item.id, item.job_id, item.attempt, "bad", "no", retryable=False)

    first, second = db.connect(), db.connect()
    try:
        counted = {}
        for conn, owner, ok, bad in ((first, "w1", a, b), (second, "w2", b, a)):
            conn.begin()
            # A write that waited for the other connection's rows would wait for good here
            # (both are this thread's): it fails instead.
            conn.execute(sa.text("SET LOCAL lock_timeout = '5s'"))
            counted[owner] = ledger.Counts()
            mine = held[owner]
            assert ledger.complete(conn, owner, [done_for(mine[ok])], counted[owner])
            assert ledger.fail(
                conn, owner, [failure(mine[bad])], max_attempts=3, counted=counted[owner]
            )
        ledger.add_counts(first, counted["w1"])
        errors: list[BaseException] = []

        def add_second() -> None:
            try:
                ledger.add_counts(second, counted["w2"])
            except BaseException as error:  # noqa: BLE001 - reported by the test below
                errors.append(error)

        waiting = threading.Thread(target=add_second)
        waiting.start()  # waits for the first's rows, taken in the same order
        first.commit()
        waiting.join(timeout=10)
        assert not waiting.is_alive()
        assert errors == []
        second.commit()
    finally:
        first.close()
        second.close()
    for job in (a, b):
        with db.begin() as conn:
            ledger.finalize_jobs(conn, [job])
        assert check_invariants(db, job) == {
            "succeeded": 1,
            "failed": 1,
            "cancelled": 0,
            "expired": 0,
            "pending": 0,
            "running": 0,
        }


def test_a_store_takes_the_job_row_only_at_its_end(db: sa.Engine, settings: Settings) -> None:
    """A store's fenced update of its items and insert of their results wait for no other
    store of the job: the job's row is written once, last (ledger/counts.py)."""
    job_id = seed_job(db, settings, n=4)
    a, b = claim(db, job_id, "w1", 2), claim(db, job_id, "w2", 2)
    with db.connect() as holder, db.connect() as other:
        holder.begin()
        ledger.complete(holder, "w1", [done_for(c) for c in a])  # holds the job's row
        other.begin()
        other.execute(sa.text("SET LOCAL lock_timeout = '200ms'"))
        # The items and results of w2's store go in while w1's store is still open...
        stored = other.execute(
            ledger.items._COMPLETE,
            {"owner": "w2", "rows": ledger.items.results_json([done_for(c) for c in b])},
        ).all()
        assert len(stored) == 2
        # ...and only adding to the counts waits for w1's commit.
        with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
            ledger.counts.add_ended(other, [(job_id, "succeeded")] * 2)
        other.rollback()
        holder.commit()


def test_status_sets_in_sql_come_from_the_enums() -> None:
    """A list of statuses spelled out in SQL drifts when a status is added; the modules build
    theirs from the model's enums (ledger.sql_in). models.py is exempt: its partial indexes
    are DDL, checked against the migrations by test_migrations."""
    import re

    from tests.helpers import ROOT as root

    spelled = re.compile(r"IN \(\s*'")
    offenders = [
        str(path.relative_to(root))
        for package in ("api", "thinkbatch", "worker")
        for path in (root / package).rglob("*.py")
        if path.name != "models.py" and spelled.search(path.read_text())
    ]
    assert offenders == []


RELEASES = {
    "graceful": lambda conn, items: ledger.release(
        conn, "w1", [(i.id, i.job_id, i.attempt) for i in items]
    ),
    "crashed": lambda conn, items: ledger.release_crashed(
        conn, "w1", max_attempts=3, code="engine_crash", message="x"
    ),
    "lapsed": lambda conn, items: (
        conn.execute(sa.text("UPDATE items SET lease_expires_at = now() - interval '1 second'")),
        ledger.release_lapsed(conn, "w1"),
    ),
}


@pytest.mark.parametrize("how", sorted(RELEASES))
def test_items_released_from_a_cancelling_job_end_cancelled(
    db: sa.Engine, settings: Settings, how: str
) -> None:
    """Every path back to pending: nobody claims for a cancelling job, so a released item
    would keep it `cancelling` for good. The items end cancelled and the job with them."""
    job_id = seed_job(db, settings, n=4)
    register(db, "w1")
    items = claim(db, job_id, "w1", 3)  # three running, one still pending
    with db.begin() as conn:
        assert ledger.cancel_job(conn, job_id) == (True, "cancelling")
        RELEASES[how](conn, items)
    counts = check_invariants(db, job_id)
    assert counts["cancelled"] == 4
    with db.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id})
        assert status.scalar_one() == "cancelled"


@pytest.mark.parametrize("how", sorted(RELEASES))
def test_items_released_from_a_running_job_are_pending_again(
    db: sa.Engine, settings: Settings, how: str
) -> None:
    job_id = seed_job(db, settings, n=3)
    register(db, "w1")
    items = claim(db, job_id, "w1", 3)
    with db.begin() as conn:
        RELEASES[how](conn, items)
    with db.connect() as conn:
        rows = conn.execute(sa.text("SELECT status FROM items WHERE job_id = :id"), {"id": job_id})
        assert set(rows.scalars()) == {"pending"}
    check_invariants(db, job_id, finished=False)


def _lock_timeout(conn: sa.Connection) -> None:
    # A wait on a row lock fails fast (LockNotAvailable) instead of blocking the test.
    conn.execute(sa.text("SET LOCAL lock_timeout = '1s'"))


def test_a_claim_and_a_store_of_one_job_do_not_wait_for_each_other(
    db: sa.Engine, settings: Settings
) -> None:
    """A claim moves items between pending and running, which changes no count of the job, so
    it takes the job row's weakest lock: a store of the same job, whose triggers update the
    row, neither waits for an open claim nor makes one wait (migration 0004)."""
    job_id = seed_job(db, settings, n=30)
    register(db, "w1", "w2")
    first = claim(db, job_id, "w1", 10)
    with db.connect() as storing, db.connect() as claiming:
        with storing.begin():
            assert ledger.complete(storing, "w1", [done_for(i) for i in first[:5]])
            with claiming.begin():  # while the store is not committed
                _lock_timeout(claiming)
                second = ledger.claim(claiming, job_id, owner="w2", n=10, lease_s=60)
                assert len(second) == 10
        with claiming.begin():
            third = ledger.claim(claiming, job_id, owner="w2", n=5, lease_s=60)
            with storing.begin():  # while the claim is not committed
                _lock_timeout(storing)
                assert ledger.complete(storing, "w1", [done_for(i) for i in first[5:]])
    assert len(third) == 5
    counts = check_invariants(db, job_id, finished=False)
    assert counts == {
        "succeeded": 10, "failed": 0, "cancelled": 0, "expired": 0, "pending": 5, "running": 15,
    }  # fmt: skip


def test_a_cancel_waits_for_an_open_claim_and_a_claim_for_an_open_cancel(
    db: sa.Engine, settings: Settings
) -> None:
    """What the claim's weak lock still excludes: a change of the job's status. A cancel cannot
    overlap a claim, so it never misses items a claim is leasing, and a claim that waited for a
    cancel sees the job cancelling and takes nothing."""
    job_id = seed_job(db, settings, n=10)
    register(db, "w1")
    with db.connect() as claiming, db.connect() as cancelling:
        with claiming.begin():
            assert len(ledger.claim(claiming, job_id, owner="w1", n=3, lease_s=60)) == 3
            with pytest.raises(sa.exc.OperationalError, match="lock timeout"):
                with cancelling.begin():
                    _lock_timeout(cancelling)
                    ledger.cancel_job(cancelling, job_id)
        cancelled = threading.Event()

        def claim_meanwhile() -> None:
            with db.begin() as conn:
                cancelled.wait(10)
                claimed.extend(ledger.claim(conn, job_id, owner="w1", n=10, lease_s=60))

        claimed: list[ledger.Claimed] = []
        with cancelling.begin():
            assert ledger.cancel_job(cancelling, job_id) == (True, "cancelling")
            waiter = threading.Thread(target=claim_meanwhile)
            waiter.start()
            cancelled.set()  # the claim now waits for this transaction's lock
            waiter.join(0.5)
            assert waiter.is_alive()
        waiter.join(10)
    assert claimed == []
    counts = check_invariants(db, job_id, finished=False)
    assert (counts["running"], counts["cancelled"], counts["pending"]) == (3, 7, 0)
