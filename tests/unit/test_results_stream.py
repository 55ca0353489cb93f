"""A job's rows streamed from one statement (thinkbatch/jobs/results.py `stream`) against real
Postgres: every row in order, one snapshot for the whole download, a download abandoned
part-way leaves its connection clean for the next user of the pool, and a client that pauses
reading still gets every row."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from tests.helpers import seed_job
from thinkbatch.jobs import results
from thinkbatch.models import ItemStatus
from thinkbatch.settings import Settings

N = 2_500  # more rows than two chunks of the stream


@pytest.fixture
def engine(database_url: str) -> Iterator[sa.Engine]:
    # One connection in the pool: the next checkout is the connection the download used.
    engine = sa.create_engine(database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def test_every_row_in_order_from_one_snapshot(
    db: sa.Engine, settings: Settings, engine: sa.Engine
) -> None:
    job_id = seed_job(db, settings, n=N)
    rows = results.stream(engine, results.query(job_id), batch=1000)
    first = [next(rows) for _ in range(10)]
    # Written after the download began: a later snapshot's, so not in this download.
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE items SET error_code = 'later' WHERE job_id = :j"), {"j": job_id}
        )
    seen = first + list(rows)
    assert [r.seq for r in seen] == list(range(N))
    assert {r.error_code for r in seen} == {None}
    assert [r.custom_id for r in seen[:3]] == ["i0", "i1", "i2"]


def test_an_abandoned_download_leaves_its_connection_clean(
    db: sa.Engine, settings: Settings, engine: sa.Engine
) -> None:
    job_id = seed_job(db, settings, n=N)
    _widen(db, job_id)  # more than the sockets hold
    with engine.connect() as conn:
        first = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    for taken in (10, 1200, 2400):  # abandoned in the head, in the rest's first chunk and later
        rows = results.stream(engine, results.query(job_id), batch=1000)
        for _ in range(taken):
            next(rows)
        rows.close()  # what the WSGI server does when the client goes away
        with engine.connect() as conn:
            backend = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            assert backend == first  # the pool kept it: its reset did not fail
            # The same connection, now answering a new statement at once.
            assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar_one() == N
        with db.connect() as watcher:
            state = watcher.execute(
                sa.text("SELECT state FROM pg_stat_activity WHERE pid = :p"), {"p": backend}
            ).scalar_one()
        assert state == "idle"
    assert [r.seq for r in results.stream(engine, results.query(job_id))][-1] == N - 1


def _widen(db: sa.Engine, job_id: uuid.UUID) -> None:
    """Give each row 16 KB, 40 MB in all: more than loopback's socket buffers hold."""
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE items SET error_message = repeat('x', 16000) WHERE job_id = :j"),
            {"j": job_id},
        )


def test_a_client_that_pauses_gets_the_whole_download(
    db: sa.Engine, settings: Settings, database_url: str
) -> None:
    """Postgres blocked on a full socket for longer than the session's tcp_user_timeout (here
    1 s; WORKER_DEAD_AFTER_S in production) must not end the download."""
    if not sa.make_url(database_url).host:
        pytest.skip("a Unix socket has no tcp_user_timeout")
    job_id = seed_job(db, settings, n=N)
    _widen(db, job_id)
    engine = sa.create_engine(
        database_url, pool_size=1, max_overflow=0,
        connect_args={"options": "-c tcp_user_timeout=1000 -c statement_timeout=1000"},
    )  # fmt: skip
    try:
        rows = results.stream(engine, results.query(job_id), batch=100)
        seen = [next(rows) for _ in range(10)]
        time.sleep(3)  # the client stops reading; Postgres fills the socket and waits
        seen += list(rows)
        assert [r.seq for r in seen] == list(range(N))
        assert all(len(r.error_message or "") == 16000 for r in seen)
    finally:
        engine.dispose()


def test_a_small_download_is_one_prepared_statement_planned_once(
    db: sa.Engine, settings: Settings, engine: sa.Engine
) -> None:
    """A job no larger than the head is read whole by its prepared statement: on the pooled
    connection, each later download of any job of that shape runs the statement Postgres
    already holds, and nothing is streamed past the head (exactly `batch` rows: a rest that
    finds nothing)."""
    small = seed_job(db, settings, n=40)
    exact = seed_job(db, settings, n=50)
    for job_id, n in ((small, 40), (exact, 50), (small, 40)):
        rows = list(results.of_job(engine, job_id, batch=50))
        assert [r.seq for r in rows] == list(range(n))
    with engine.connect() as conn:
        prepared = (
            conn.execute(
                sa.text("SELECT statement FROM pg_prepared_statements WHERE statement LIKE :s"),
                {"s": "%FROM items LEFT OUTER JOIN item_results%LIMIT $2%"},
            )
            .scalars()
            .all()
        )
    assert len(prepared) == 1


def test_a_missing_job_streams_nothing(db: sa.Engine, engine: sa.Engine) -> None:
    assert list(results.stream(engine, results.query(uuid.uuid4()))) == []


def test_a_libpq_without_chunked_mode_streams_row_by_row(
    db: sa.Engine, settings: Settings, engine: sa.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = seed_job(db, settings, n=N)
    monkeypatch.setattr(results.psycopg.pq, "version", lambda: 160_000)
    assert results._chunk(1000) == 1
    assert [r.seq for r in results.stream(engine, results.query(job_id))] == list(range(N))


def test_one_compiled_statement_serves_each_job_its_own_rows(
    db: sa.Engine, settings: Settings, engine: sa.Engine
) -> None:
    """A download's statement is compiled once per shape and bound to each job: the second
    job's download reads its own rows through the first job's compiled text, of the status
    asked for."""
    first = seed_job(db, settings, n=3)
    second = seed_job(db, settings, n=5)
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE items SET status = 'failed' WHERE job_id = :j AND seq = 4"),
            {"j": second},
        )
    for job_id, n in ((first, 3), (second, 5), (first, 3)):
        rows = list(results.of_job(engine, job_id))
        assert [r.custom_id for r in rows] == [f"i{k}" for k in range(n)]
    failed = list(results.of_job(engine, second, status=ItemStatus.failed))
    assert [(r.custom_id, r.status) for r in failed] == [("i4", "failed")]
    assert list(results.of_job(engine, first, status=ItemStatus.failed)) == []
    others = list(results.of_job(engine, second, succeeded=False, include_thinking=False))
    assert [r.custom_id for r in others] == [f"i{k}" for k in range(5)]
    shapes = results.download_statement.cache_info()
    assert shapes.hits >= 1  # the first job's plain download was served by the compiled text
