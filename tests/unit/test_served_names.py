"""A served name means one thing across the fleet: a worker whose base model or adapters take a
name that a live worker of another base model serves is refused at registration, atomically,
and before its engine loads. Workers of one base model may differ in adapters, and a name held
by a stopped or silent worker is free."""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from tests.helpers import make_settings
from thinkbatch import ledger
from thinkbatch.ledger import ServedNameTaken
from worker.runner import check_served_names

DEAD_AFTER_S = 60.0


def register(
    conn: sa.Connection, owner: str, model: str, adapters: list[str] | None = None
) -> None:
    ledger.register_worker(
        conn,
        owner,
        hostname=f"host-{owner}",
        pid=1,
        model=model,
        adapters=adapters,
        dead_after_s=DEAD_AFTER_S,
    )


def registered(db: sa.Engine) -> set[str]:
    with db.connect() as conn:
        return set(conn.execute(sa.text("SELECT id FROM workers")).scalars())


@pytest.mark.parametrize(
    ("first", "second", "clash"),
    [
        # An adapter of B named like base A, and base A started after such an adapter.
        (("a", "qwen-a", None), ("b", "qwen-b", ["qwen-a"]), ("qwen-a", "a", False)),
        (("b", "qwen-b", ["qwen-a"]), ("a", "qwen-a", None), ("qwen-a", "b", True)),
        # Adapters of two bases sharing a name.
        (("a", "qwen-a", ["sql", "x"]), ("b", "qwen-b", ["sql"]), ("sql", "a", True)),
    ],
)
def test_a_name_another_base_model_serves_refuses_the_worker(
    db: sa.Engine,
    first: tuple[str, str, list[str] | None],
    second: tuple[str, str, list[str] | None],
    clash: tuple[str, str, bool],
) -> None:
    with db.begin() as conn:
        register(conn, *first)
    with pytest.raises(ServedNameTaken) as refused, db.begin() as conn:
        register(conn, *second)
    name, holder, as_adapter = clash
    assert [(c.name, c.worker_id, c.model, c.as_adapter) for c in refused.value.clashes] == [
        (name, holder, first[1], as_adapter)
    ]
    message = str(refused.value)
    assert repr(name) in message and f"host-{holder}" in message
    assert registered(db) == {first[0]}  # nothing of the refused worker is stored


def test_workers_of_one_base_model_may_serve_different_adapters(db: sa.Engine) -> None:
    with db.begin() as conn:
        register(conn, "a1", "qwen-a", ["sql"])
        register(conn, "a2", "qwen-a", ["sql", "new"])  # a set rolling out a new adapter
        register(conn, "a3", "qwen-a")
        register(conn, "b", "qwen-b", ["other"])
    assert registered(db) == {"a1", "a2", "a3", "b"}


def test_a_name_held_by_a_stopped_or_silent_worker_is_free(db: sa.Engine) -> None:
    with db.begin() as conn:
        register(conn, "stopped", "qwen-a", ["sql"])
        ledger.mark_stopped(conn, "stopped")
        register(conn, "silent", "qwen-c", ["sql"])
        # Heard from longer ago than DEAD_AFTER_S: judged dead, by the database's clock.
        conn.execute(
            sa.text(
                "UPDATE workers SET heartbeat_at = now() - interval '2 minutes' WHERE id = 'silent'"
            )
        )
    with db.begin() as conn:
        register(conn, "b", "qwen-b", ["sql"])
    assert "b" in registered(db)


def test_two_workers_registering_at_once_with_one_name_cannot_both_pass(db: sa.Engine) -> None:
    first = db.connect()
    try:
        tx = first.begin()
        register(first, "a", "qwen-a", ["sql"])  # holds the registration lock until it commits
        outcome: list[object] = []

        def second() -> None:
            try:
                with db.begin() as conn:
                    register(conn, "b", "qwen-b", ["sql"])
                outcome.append("registered")
            except ServedNameTaken as error:
                outcome.append(error)

        thread = threading.Thread(target=second)
        thread.start()
        time.sleep(0.5)
        assert outcome == []  # waiting for the first registration, not reading around it
        tx.commit()
        thread.join(10)
    finally:
        first.close()
    assert len(outcome) == 1 and isinstance(outcome[0], ServedNameTaken)
    assert registered(db) == {"a"}


def test_a_worker_is_refused_before_its_engine_loads(
    db: sa.Engine, database_url: str, redis_url: str
) -> None:
    with db.begin() as conn:
        register(conn, "a", "qwen-a")
    clashing = make_settings(database_url, redis_url).model_copy(
        update={"served_model_name": "qwen-b", "lora_adapters": {"qwen-a": "/adapters/a"}}
    )
    with pytest.raises(ServedNameTaken, match="'qwen-a' is served by worker a on host-a"):
        check_served_names(clashing, db)
    apart = clashing.model_copy(update={"lora_adapters": {"sql": "/adapters/sql"}})
    check_served_names(apart, db)  # its own names: no clash


def test_a_worker_judged_dead_cannot_come_back_to_names_taken_since(db: sa.Engine) -> None:
    with db.begin() as conn:
        register(conn, "a", "qwen-a", ["sql"])
        register(conn, "quiet", "qwen-a", ["other"])
        # Judged dead during an outage: its names are free, and another base model takes one.
        ledger.mark_stopped(conn, "a")
        ledger.mark_stopped(conn, "quiet")
        register(conn, "b", "qwen-b", ["sql"])
    with pytest.raises(ServedNameTaken, match="'sql' is served by worker b"), db.begin() as conn:
        ledger.beat(conn, "a", dead_after_s=DEAD_AFTER_S)
    with db.begin() as conn:
        ledger.beat(conn, "quiet", dead_after_s=DEAD_AFTER_S)  # nothing of its own was taken
    with db.connect() as conn:
        stopped = dict(
            conn.execute(sa.text("SELECT id, stopped_at IS NOT NULL FROM workers")).all()
        )
    assert stopped == {"a": True, "quiet": False, "b": False}


def test_a_runner_back_to_taken_names_hands_back_its_items_and_exits(
    db: sa.Engine, database_url: str, redis_url: str
) -> None:
    from tests.helpers import submit_job
    from tests.runner_harness import close_runner
    from worker.engine import create_engine
    from worker.runner import Runner
    from worker.runner.core import EXIT_NAMES_TAKEN

    settings = make_settings(
        database_url,
        redis_url,
        heartbeat_s=0.2,
        worker_dead_after_s=1,
        served_model_name="qwen-a",
        served_models=["qwen-a"],
        lora_adapters={"sql": "/adapters/sql"},
        engine_extra_args={"step_s": 0.05},
    )
    exits: list[int] = []
    runner = Runner(
        settings, engine=create_engine(settings), db=db, publish=lambda _: True,
        exit_process=exits.append,
    )  # fmt: skip
    runner.start()
    try:
        long_items = {"ignore_eos": True, "max_tokens": 4000}
        job_id = submit_job(
            db, settings, {"model": "qwen-a", "items": [{"prompt": "x"}] * 4, "params": long_items}
        )
        threading.Thread(target=runner.drive, args=(job_id, lambda d, t: None), daemon=True).start()
        deadline = time.monotonic() + 10
        while runner.items_in_engine == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with db.begin() as conn:
            ledger.mark_stopped(conn, runner.owner)  # as the sweeper judges a silent worker
            register(conn, "b", "qwen-b", ["sql"])
        deadline = time.monotonic() + 30
        while not exits:
            assert time.monotonic() < deadline, "the runner did not leave"
            time.sleep(0.05)
        assert exits == [EXIT_NAMES_TAKEN]
        with db.connect() as conn:
            held = conn.execute(
                sa.text("SELECT count(*) FROM items WHERE lease_owner = :o AND status = 'running'"),
                {"o": runner.owner},
            ).scalar()
            stopped = conn.execute(
                sa.text("SELECT stopped_at IS NOT NULL FROM workers WHERE id = :o"),
                {"o": runner.owner},
            ).scalar()
        assert held == 0 and stopped  # handed back; and not back among the live workers
    finally:
        close_runner(runner, timeout=10)
