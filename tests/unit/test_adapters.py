"""LoRA adapters on the fake engine, through the runner: an item naming an adapter runs on it,
an item naming the base model (or none) on the base, and the worker registers its adapters."""

from __future__ import annotations

import sqlalchemy as sa

from tests.helpers import job_records
from tests.helpers import submit_job
from tests.runner_harness import Harness
from tests.runner_harness import wait_status

ADAPTERS = {"demo-pirate": "/adapters/pirate", "demo-poet": "/adapters/poet"}
QUESTION = [{"role": "user", "content": "What is continuous batching?"}]
GREEDY = {"temperature": 0.0, "enable_thinking": False}


def test_items_run_on_the_adapter_they_name_and_the_rest_on_the_base(harness: Harness) -> None:
    harness.settings = harness.settings.model_copy(update={"lora_adapters": ADAPTERS})
    runner = harness.runner()
    base = harness.settings.model_name
    items = [
        {"custom_id": "job-model", "messages": QUESTION, "params": GREEDY},
        {"custom_id": "base", "model": base, "messages": QUESTION, "params": GREEDY},
        *(
            {"custom_id": name, "model": name, "messages": QUESTION, "params": GREEDY}
            for name in ADAPTERS
        ),
    ]
    job_id = submit_job(harness.db, harness.settings, {"model": base, "items": items})
    thread, _ = harness.drive(runner, job_id)
    thread.join(30)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == len(items)

    got = job_records(harness.db, harness.settings, job_id)
    plain = got["base"]["answer"]
    assert plain.startswith("Answer: ")
    assert got["job-model"]["answer"] == plain
    assert {got[k]["model"] for k in ("base", "job-model")} == {base}
    for name in ADAPTERS:
        assert got[name]["model"] == name
        assert got[name]["answer"] == f"[{name}] {plain}"

    with harness.db.connect() as conn:
        row = conn.execute(
            sa.text("SELECT model, adapters FROM workers WHERE id = :id"), {"id": runner.owner}
        ).one()
    assert (row.model, row.adapters) == (base, list(ADAPTERS))
    assert runner.describe()["adapters"] == list(ADAPTERS)


def test_a_worker_without_adapters_registers_none(harness: Harness) -> None:
    runner = harness.runner()
    with harness.db.connect() as conn:
        adapters = conn.execute(
            sa.text("SELECT adapters FROM workers WHERE id = :id"), {"id": runner.owner}
        ).scalar_one()
    assert adapters is None
    assert runner.describe()["adapters"] == []
