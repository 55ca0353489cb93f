"""The autoscaler's query (thinkbatch/autoscale.py), run on the real Postgres while jobs are
stored, claimed, cancelled and failed: its count of a model's work is the API's own count of
that model's pending and running items, and nobody else's."""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from flask.testing import FlaskClient

from tests.helpers import seed_job
from thinkbatch import ledger
from thinkbatch.autoscale import pending_work_sql
from thinkbatch.autoscale import sql_literal
from thinkbatch.settings import Settings

OTHER = "Qwen/Qwen3-32B"


def _scaler_count(db: sa.Engine, model: str) -> int:
    with db.connect() as conn:
        # The text as KEDA sends it: no parameters, one row of one number.
        (row,) = conn.exec_driver_sql(pending_work_sql(model)).all()
    (count,) = row
    return int(count)


def _api_count(client: FlaskClient, job_ids: list[uuid.UUID]) -> int:
    total = 0
    for job_id in job_ids:
        response = client.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.json
        counts = response.json["counts"]
        total += counts["pending"] + counts["running"]
    return total


def test_the_scalers_count_is_the_apis_pending_and_running(
    db: sa.Engine, settings: Settings, client: FlaskClient
) -> None:
    model = settings.model_name
    assert _scaler_count(db, model) == 0  # no work: the scaler may go to zero
    claimed = seed_job(db, settings, n=7)
    cancelled = seed_job(db, settings, n=4)
    failing = seed_job(db, settings, n=3)
    other = seed_job(db, settings, n=5)
    with db.begin() as conn:
        # Another model's job: it waits for other workers, and must not wake these.
        move = sa.text(
            "UPDATE jobs SET model = CAST(:m AS text), "
            "models = jsonb_build_array(CAST(:m AS text)) WHERE id = :id"
        )
        conn.execute(move, {"m": OTHER, "id": other})
    mine = [claimed, cancelled, failing]
    assert _scaler_count(db, model) == _api_count(client, mine) == 14  # a job arrived: wake

    with db.begin() as conn:
        running = ledger.claim(conn, claimed, owner="w1", n=3, lease_s=60)
        doomed = ledger.claim(conn, failing, owner="w1", n=3, lease_s=60)
    assert len(running) == 3 and len(doomed) == 3
    # Running items count as much as pending ones: their worker must not be scaled away.
    assert _scaler_count(db, model) == _api_count(client, mine) == 14

    assert client.post(f"/v1/jobs/{cancelled}/cancel").status_code == 200
    with db.begin() as conn:
        failures = [
            ledger.Failed(c.id, c.job_id, c.attempt, "engine_error", "x", retryable=False)
            for c in doomed
        ]
        ledger.fail(conn, "w1", failures, max_attempts=3)
    assert _api_count(client, [cancelled, failing]) == 0
    assert _scaler_count(db, model) == _api_count(client, mine) == 7
    assert _scaler_count(db, OTHER) == _api_count(client, [other]) == 5
    assert _scaler_count(db, "Qwen/Qwen3-0.6B") == 0


def test_a_model_and_its_adapters_count_together(db: sa.Engine, settings: Settings) -> None:
    from tests.helpers import submit_job

    model = settings.model_name
    body = {"items": [{"prompt": "a"}, {"prompt": "b", "model": "lora-x"}, {"prompt": "c"}]}
    settings = settings.model_copy(update={"served_models": [model, "lora-x"]})
    submit_job(db, settings, body)
    assert _scaler_count(db, model) == 2
    with db.connect() as conn:
        (row,) = conn.exec_driver_sql(pending_work_sql(model, "lora-x")).all()
    assert row[0] == 3


def test_a_model_name_is_quoted_as_data() -> None:
    assert sql_literal("Qwen/Qwen3-8B") == "'Qwen/Qwen3-8B'"
    assert sql_literal("it's") == "'it''s'"
    assert sql_literal("a\\b") == "'a\\b'"  # standard_conforming_strings: no escapes
    sql = pending_work_sql("x' OR '1'='1")
    assert "ARRAY['x'' OR ''1''=''1']" in sql and "IN ('x'' OR ''1''=''1')" in sql


def test_a_hostile_model_name_counts_nothing(db: sa.Engine, settings: Settings) -> None:
    seed_job(db, settings, n=2)
    assert _scaler_count(db, "x' OR '1'='1") == 0
    assert _scaler_count(db, "back\\slash'; SELECT 1; --") == 0


def test_a_job_past_its_window_wakes_no_worker_for_its_pending_items(
    db: sa.Engine, settings: Settings
) -> None:
    model = settings.model_name
    job = seed_job(db, settings, n=5)
    with db.begin() as conn:
        assert len(ledger.claim(conn, job, owner="w1", n=2, lease_s=60)) == 2
        conn.execute(
            sa.text("UPDATE jobs SET expires_at = now() - interval '1 s' WHERE id = :id"),
            {"id": job},
        )
    # Its running items keep their worker until they end; the pending ones will never run.
    assert _scaler_count(db, model) == 2
