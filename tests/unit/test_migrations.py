"""The Alembic migrations build exactly the schema the models describe."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tests.helpers import Servers
from tests.helpers import database_name
from tests.helpers import recreate_database
from thinkbatch import ledger
from thinkbatch.db import migrate
from thinkbatch.ledger import ModelFilter
from thinkbatch.models import Base
from thinkbatch.models import Job


def test_upgrade_head_on_empty_database_matches_models(servers: Servers) -> None:
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        triggers = set(
            conn.execute(sa.text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")).scalars()
        )
    engine.dispose()
    assert diff == []
    # The ledger keeps a job's counts as items end (ledger/counts.py): no trigger on an update.
    assert triggers == {
        "tb_items_counts_insert",
        "tb_items_counts_delete",
        "tb_items_delete_results",
        "tb_jobs_delete_items",
        "tb_jobs_truncate_items",
    }


def _counts(conn: sa.Connection, job_id: object) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the job row's counts and usage, the same recounted from its items and results)."""
    kept = conn.execute(
        sa.text(
            "SELECT total, unfinished, succeeded, failed, cancelled, prompt_tokens,"
            " completion_tokens FROM jobs WHERE id = :id"
        ),
        {"id": job_id},
    ).one()
    recounted = conn.execute(
        sa.text(
            "SELECT count(*), count(*) FILTER (WHERE status IN ('pending', 'running')),"
            " count(*) FILTER (WHERE status = 'succeeded'),"
            " count(*) FILTER (WHERE status = 'failed'),"
            " count(*) FILTER (WHERE status = 'cancelled'),"
            " (SELECT coalesce(sum(prompt_tokens), 0) FROM item_results WHERE job_id = :id),"
            " (SELECT coalesce(sum(completion_tokens), 0) FROM item_results WHERE job_id = :id)"
            " FROM items WHERE job_id = :id"
        ),
        {"id": job_id},
    ).one()
    return tuple(kept), tuple(recounted)


def _running_job(conn: sa.Connection) -> object:
    """A running job's row with the columns every revision here has; its id."""
    return conn.execute(
        sa.text(
            "INSERT INTO jobs (id, tenant, status, model, params, priority, created_at,"
            " expires_at) VALUES (gen_random_uuid(), 't', 'running', 'm', '{}', 0, now(),"
            " now() + interval '1 day') RETURNING id"
        )
    ).scalar_one()


def _running_items(conn: sa.Connection, job_id: object, n: int) -> list[ledger.Done]:
    """`n` items of the job leased to worker `w1`, and a result ready to store for each."""
    conn.execute(
        sa.text(
            "INSERT INTO items (job_id, seq, custom_id, prompt, status, attempts,"
            " lease_owner, lease_expires_at)"
            " SELECT :j, k, 'c' || k, 'p', 'running', 1, 'w1', now() + interval '1 hour'"
            " FROM generate_series(0, :last) AS k"
        ),
        {"j": job_id, "last": n - 1},
    )
    running = conn.execute(
        sa.text("SELECT id, attempts FROM items WHERE job_id = :j ORDER BY seq"), {"j": job_id}
    ).all()
    return [ledger.Done(r.id, job_id, r.attempts, "", "a", "stop", False, 5, 2, 1) for r in running]


def test_counts_by_the_ledger_on_a_populated_database(servers: Servers) -> None:
    """0008 moves a job's counts from the update triggers to the ledger: a job stored and half
    run before it keeps its counts through the upgrade, the ledger then counts on from them
    exactly once (no trigger left to count twice), and a deleted job takes its results along
    without the foreign keys; down again, the triggers count once more."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0007")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        job_id = _running_job(conn)
        conn.execute(
            sa.text(
                "INSERT INTO items (job_id, seq, custom_id, prompt, status)"
                " SELECT :j, k, 'c' || k, 'p', 'pending' FROM generate_series(0, 5) AS k"
            ),
            {"j": job_id},
        )
        # Under 0007's triggers: one item succeeded with its result, one failed, two running.
        conn.execute(
            sa.text(
                "UPDATE items SET status = CASE seq WHEN 0 THEN 'succeeded' WHEN 1 THEN 'failed'"
                " ELSE 'running' END, attempts = 1, lease_owner = 'w1',"
                " lease_expires_at = now() + interval '1 hour' WHERE job_id = :j AND seq < 4"
            ),
            {"j": job_id},
        )
        conn.execute(
            sa.text(
                "INSERT INTO item_results (item_id, job_id, attempt, thinking, answer,"
                " finish_reason, thinking_truncated, prompt_tokens, completion_tokens,"
                " reasoning_tokens, worker_id)"
                " SELECT id, job_id, 1, '', 'a', 'stop', false, 7, 3, 0, 'w1' FROM items"
                " WHERE job_id = :j AND seq = 0"
            ),
            {"j": job_id},
        )
        before = _counts(conn, job_id)
    assert before[0] == before[1] == (6, 4, 1, 1, 0, 7, 3)

    migrate(url)
    with engine.begin() as conn:
        assert _counts(conn, job_id) == before
        running = conn.execute(
            sa.text("SELECT id, attempts FROM items WHERE job_id = :j AND status = 'running'"),
            {"j": job_id},
        ).all()
        done = [
            ledger.Done(row.id, job_id, row.attempts, "", "a", "stop", False, 5, 2, 1)
            for row in running
        ]
        assert len(ledger.complete(conn, "w1", done)) == 2
        ledger.cancel_job(conn, job_id)
        kept, recounted = _counts(conn, job_id)
    assert kept == recounted == (6, 0, 3, 1, 2, 17, 7)

    migrate(url, "0007", down=True)
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE items SET status = 'pending' WHERE job_id = :j AND seq = 5"),
            {"j": job_id},
        )
        kept, recounted = _counts(conn, job_id)
        assert kept == recounted  # the update trigger is back and counted the move
    migrate(url)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM jobs WHERE id = :j"), {"j": job_id})
        left = conn.execute(sa.text("SELECT count(*) FROM item_results")).scalar_one()
    engine.dispose()
    assert left == 0


def test_downgrade_to_base_and_back(servers: Servers) -> None:
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url)
    migrate(url, "base", down=True)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    migrate(url)  # and up again from scratch


def test_count_deltas_on_a_populated_database(servers: Servers) -> None:
    """0009 gives each worker's stores delta rows of their own: a job half run before it keeps
    its counts through the upgrade, a worker's store then adds to its deltas (the job's row
    unchanged), reads add them; down again, the deltas are folded into the row before the
    table goes, and the counts still equal a recount of the items."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0008")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        job_id = _running_job(conn)
        done = _running_items(conn, job_id, 6)
        ledger.complete(conn, "w1", done[:2])  # under 0008: into the job's row
        before = _counts(conn, job_id)
    assert before[0] == before[1] == (6, 4, 2, 0, 0, 10, 4)

    migrate(url)
    with engine.begin() as conn:
        assert _counts(conn, job_id) == before
        counted = ledger.Counts()
        assert len(ledger.complete(conn, "w1", done[2:5], counted)) == 3
        ledger.add_counts(conn, counted, writer="w1")
        assert _counts(conn, job_id)[0] == before[0]  # the row is left alone
        as_read = conn.execute(
            sa.select(Job.unfinished, Job.succeeded, Job.prompt_tokens).where(Job.id == job_id)
        ).one()
        assert tuple(as_read) == (1, 5, 25)

    migrate(url, "0008", down=True)
    with engine.begin() as conn:
        kept, recounted = _counts(conn, job_id)
    engine.dispose()
    assert kept == recounted == (6, 1, 5, 0, 0, 25, 10)


def test_prefix_order_on_a_populated_database(servers: Servers) -> None:
    """0010 adds the claim key: a job stored before it, half claimed, keeps its items and is
    claimed on in seq order (its keys are NULL); down again, the key and its index are gone
    and the claim index of a named model is the old one."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0009")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        job_id = _running_job(conn)
        conn.execute(
            sa.text(
                "INSERT INTO items (job_id, seq, custom_id, prompt, status)"
                " SELECT :j, k, 'c' || k, repeat('shared beginning ', 40) || k, 'pending'"
                " FROM generate_series(0, 9) AS k"
            ),
            {"j": job_id},
        )
        conn.execute(  # three claimed by a worker before the upgrade
            sa.text(
                "UPDATE items SET status = 'running', attempts = 1, lease_owner = 'w',"
                " lease_expires_at = now() + interval '1 hour' WHERE job_id = :j AND seq < 3"
            ),
            {"j": job_id},
        )

    migrate(url)
    rest = []
    for _ in range(8):  # one at a time: the order of the claims themselves
        with engine.begin() as conn:
            rest += ledger.claim(conn, job_id, owner="w", n=1, lease_s=60)
    with engine.connect() as conn:
        keys = conn.execute(sa.text("SELECT count(prefix_key) FROM items")).scalar()
        invalid = conn.execute(
            sa.text("SELECT count(*) FROM pg_index WHERE NOT indisvalid OR NOT indisready")
        ).scalar()
    assert [c.seq for c in rest] == list(range(3, 10)) and keys == 0
    assert invalid == 0  # the indexes built concurrently are whole

    migrate(url, "0009", down=True)
    with engine.connect() as conn:
        columns = set(
            conn.execute(
                sa.text(
                    "SELECT column_name FROM information_schema.columns WHERE table_name = 'items'"
                )
            ).scalars()
        )
        indexes = dict(
            conn.execute(
                sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'items'")
            ).all()
        )
        total = conn.execute(sa.text("SELECT count(*) FROM items")).scalar()
    engine.dispose()
    assert "prefix_key" not in columns and total == 10
    assert "ix_items_pending_prefix" not in indexes
    assert "(job_id, model, seq)" in indexes["ix_items_pending_model"]


def test_items_without_the_job_key_on_a_populated_database(servers: Servers) -> None:
    """0011 drops the items' key to their job: a job stored before it keeps its items and
    results, and deleting it still deletes them (its trigger, then the items'); down again,
    the key is back and does the same."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0010")
    engine = sa.create_engine(url)

    def stored_job(conn: sa.Connection) -> object:
        job_id = _running_job(conn)
        done = _running_items(conn, job_id, 4)
        assert len(ledger.complete(conn, "w1", done[:2])) == 2
        return job_id

    def left_of(conn: sa.Connection, job_id: object) -> tuple[int, int]:
        items = conn.execute(
            sa.text("SELECT count(*) FROM items WHERE job_id = :j"), {"j": job_id}
        ).scalar_one()
        results = conn.execute(
            sa.text("SELECT count(*) FROM item_results WHERE job_id = :j"), {"j": job_id}
        ).scalar_one()
        return items, results

    def keys(conn: sa.Connection) -> list[str]:
        return list(
            conn.execute(
                sa.text(
                    "SELECT conname FROM pg_constraint"
                    " WHERE conrelid = 'items'::regclass AND contype = 'f'"
                )
            ).scalars()
        )

    with engine.begin() as conn:
        before, kept = stored_job(conn), stored_job(conn)
    migrate(url)
    with engine.begin() as conn:
        assert keys(conn) == []
        assert left_of(conn, before) == (4, 2)
        conn.execute(sa.text("DELETE FROM jobs WHERE id = :j"), {"j": before})
        assert left_of(conn, before) == (0, 0)
        assert left_of(conn, kept) == (4, 2)  # another job's are left alone
    with engine.begin() as conn:  # an item whose job is gone, as a bulk load could leave
        conn.execute(
            sa.text(
                "INSERT INTO items (job_id, seq, custom_id, prompt, status)"
                " VALUES (gen_random_uuid(), 0, 'orphan', 'p', 'pending')"
            )
        )
    migrate(url, "0010", down=True)
    with engine.begin() as conn:
        assert keys(conn) == ["fk_items_job_id_jobs"]
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar_one() == 4
        conn.execute(sa.text("DELETE FROM jobs WHERE id = :j"), {"j": kept})
        assert left_of(conn, kept) == (0, 0)
    migrate(url)
    with engine.begin() as conn:
        again = stored_job(conn)
        conn.execute(sa.text("TRUNCATE jobs CASCADE"))
        assert left_of(conn, again) == (0, 0)
        assert conn.execute(sa.text("SELECT count(*) FROM item_results")).scalar_one() == 0
    engine.dispose()


def test_suspects_index_on_a_populated_database(servers: Servers) -> None:
    """0012 indexes a job's crash suspects: items released by a crash before the upgrade are
    in it, whole (built concurrently), and claimed as suspects after it; down again, it is
    gone and the suspects are still found."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0011")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        job_id = _running_job(conn)
        _running_items(conn, job_id, 6)
        assert ledger.release_crashed(conn, "w1", max_attempts=3, code="c", message="m") == 6

    def suspects_index(conn: sa.Connection) -> int | None:
        return conn.execute(
            sa.text(
                "SELECT count(*) FILTER (WHERE i.indisvalid AND i.indisready) FROM pg_index AS i"
                " WHERE i.indexrelid = to_regclass('ix_items_pending_suspects')"
            )
        ).scalar()

    migrate(url)
    with engine.begin() as conn:
        assert suspects_index(conn) == 1
        assert ledger.has_suspects(conn, job_id)
        entries = conn.execute(
            sa.text(
                "SELECT count(*) FROM items WHERE job_id = :j AND status = 'pending'"
                " AND crashes > 0"
            ),
            {"j": job_id},
        ).scalar()
        first = ledger.claim(conn, job_id, owner="w2", n=0, lease_s=60, suspects=True)
    assert entries == 6 and len(first) == 3  # the tier of six, in halves

    migrate(url, "0011", down=True)
    with engine.begin() as conn:
        assert suspects_index(conn) == 0
        assert ledger.has_suspects(conn, job_id)
    engine.dispose()


def test_one_pending_index_on_a_populated_database(servers: Servers) -> None:
    """0013 puts a job's pending items, its own and those naming a model, into one index:
    a mixed job stored before it, partly claimed, is claimed on by name after it, each name
    in its order; down again, the two indexes it replaced are back, whole."""
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url, "0012")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        job_id = _running_job(conn)
        conn.execute(
            sa.text('UPDATE jobs SET models = CAST(\'["m", "n"]\' AS jsonb) WHERE id = :j'),
            {"j": job_id},
        )
        conn.execute(  # even places the job's own model (m), odd ones a named one (n)
            sa.text(
                "INSERT INTO items (job_id, seq, custom_id, prompt, status, model)"
                " SELECT :j, k, 'c' || k, 'p', 'pending', CASE WHEN k % 2 = 1 THEN 'n' END"
                " FROM generate_series(0, 11) AS k"
            ),
            {"j": job_id},
        )
        first = ledger.claim(conn, job_id, owner="w", n=4, lease_s=60)

    def indexes(conn: sa.Connection) -> dict[str, bool]:
        return dict(
            conn.execute(
                sa.text(
                    "SELECT c.relname, i.indisvalid AND i.indisready FROM pg_index AS i"
                    " JOIN pg_class AS c ON c.oid = i.indexrelid"
                    " WHERE i.indrelid = 'items'::regclass AND c.relname LIKE 'ix_items_pending%'"
                )
            ).all()
        )

    migrate(url)
    with engine.begin() as conn:
        assert indexes(conn) == {"ix_items_pending": True, "ix_items_pending_suspects": True}
        named = ModelFilter.of("m", ["m", "n"], ["n"])
        rest_n = ledger.claim(conn, job_id, owner="w", n=10, lease_s=60, models=named)
        rest = ledger.claim(conn, job_id, owner="w", n=10, lease_s=60)
    assert [c.seq for c in first] == [0, 2, 1, 3]  # each model's share, in order
    assert [c.seq for c in rest_n] == [5, 7, 9, 11]
    assert [c.seq for c in rest] == [4, 6, 8, 10]

    migrate(url, "0012", down=True)
    with engine.begin() as conn:
        assert indexes(conn) == {
            "ix_items_pending_prefix": True,
            "ix_items_pending_model": True,
            "ix_items_pending_suspects": True,
        }
    engine.dispose()
