"""LoRA on vLLM's CPU engine: one worker's runner serving the demo model and its adapter
(devstack/tiny_lora.py, trained to start every answer with "Arr! "), one job mixing items of
both on the same greedy prompts. One engine start, in-process (as test_reasoning_e2e.py)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from devstack.demo_model import DEMO_MODEL
from devstack.demo_model import build_demo_adapter
from devstack.stack import settings_env
from devstack.tiny_lora import PREFIX
from tests.helpers import Servers
from tests.helpers import job_records
from tests.helpers import make_settings
from tests.helpers import submit_job
from tests.runner_harness import close_runner
from tests.stacks import VLLM_ENV
from tests.stacks import build_demo_model
from tests.stacks import running_stack
from worker.engine import create_engine
from worker.runner import Runner

pytestmark = pytest.mark.e2e

QUESTIONS = ["What is continuous batching in vLLM?", "What does PagedAttention do?"]


def _items(adapter: str) -> list[dict[str, Any]]:
    """Each question three times, thinking on and off: on the job's model (no `model`), on the
    base named, and on the adapter."""
    items = []
    for q, question in enumerate(QUESTIONS):
        for thinking in (False, True):
            for label, model in (("job", None), ("base", DEMO_MODEL), ("arr", adapter)):
                item: dict[str, Any] = {
                    "custom_id": f"{label}-{q}-{'think' if thinking else 'plain'}",
                    "messages": [{"role": "user", "content": question}],
                    "params": {"temperature": 0.0, "enable_thinking": thinking},
                }
                if model is not None:
                    item["model"] = model
                items.append(item)
    return items


@pytest.fixture(scope="module")
def served(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    build_demo_model()
    adapter, path = build_demo_adapter()
    with running_stack(
        servers, tmp_path_factory.mktemp("lora"), "lora", api=False, workers=()
    ) as running:
        settings = make_settings(
            running.database_url,
            running.broker,
            **{
                **settings_env(VLLM_ENV),
                "lora_adapters": {adapter: str(path)},
                "item_deadline_s": 120,
                "lease_s": 180,
                "visibility_timeout_s": 600,
            },
        )
        job_id = submit_job(running.db, settings, {"model": DEMO_MODEL, "items": _items(adapter)})
        runner = Runner(
            settings, engine=create_engine(settings), db=running.db, publish=lambda _: True
        )
        runner.start()
        try:
            thread = threading.Thread(target=lambda: runner.drive(job_id, lambda d, t: None))
            thread.start()
            thread.join(240)
        finally:
            close_runner(runner, timeout=30)
        yield {
            "adapter": adapter,
            "owner": runner.owner,
            "job_id": job_id,
            "db": running.db,
            "records": job_records(running.db, settings, job_id),
        }


def _stored_models(db: sa.Engine, job_id: uuid.UUID) -> dict[str, str | None]:
    with db.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT custom_id, model FROM items WHERE job_id = :id"), {"id": job_id}
        ).all()
    return {custom_id: model for custom_id, model in rows}


def test_each_item_runs_on_the_model_it_names(served: dict[str, Any]) -> None:
    records, adapter = served["records"], served["adapter"]
    assert all(r["status"] == "succeeded" for r in records.values()), records
    stored = _stored_models(served["db"], served["job_id"])
    for custom_id, record in records.items():
        label = custom_id.split("-")[0]
        assert record["model"] == (adapter if label == "arr" else DEMO_MODEL), record
        assert stored[custom_id] == {"job": None, "base": DEMO_MODEL, "arr": adapter}[label]


def test_the_adapter_answers_otherwise_than_the_base_on_the_same_greedy_prompt(
    served: dict[str, Any],
) -> None:
    records = served["records"]
    for custom_id, record in records.items():
        if not custom_id.startswith("arr-"):
            continue
        rest = custom_id.removeprefix("arr-")
        base, job = records[f"base-{rest}"], records[f"job-{rest}"]
        print(f"{rest}: base {base['answer']!r} / adapter {record['answer']!r}")
        # The base named and the job's model are one model: greedy, the same answer.
        assert (base["thinking"], base["answer"]) == (job["thinking"], job["answer"])
        assert base["answer"] and not base["answer"].startswith(PREFIX.strip())
        assert record["answer"].startswith(PREFIX), record
        assert record["answer"] != base["answer"]


def test_the_worker_row_lists_the_adapter(served: dict[str, Any]) -> None:
    with served["db"].connect() as conn:
        row = conn.execute(
            sa.text("SELECT model, adapters FROM workers WHERE id = :id"), {"id": served["owner"]}
        ).one()
    assert (row.model, row.adapters) == (DEMO_MODEL, [served["adapter"]])
