"""Two models on one service, as real processes: gunicorn and two Celery workers on the fake
engine, each serving a different name. A mixed job and a mixed OpenAI batch (through the
official SDK) run every item on a worker of the model it names, also when one worker is killed
(SIGKILL) mid-job and started again; nothing is lost or stored twice."""

from __future__ import annotations

import io
import json
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from openai import OpenAI
from openai.types.chat import ChatCompletion

from devstack.stack import Proc
from devstack.stack import Stack
from tests.helpers import Servers
from tests.helpers import check_invariants
from tests.helpers import lost_and_duplicated
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import Client
from tests.stacks import RunningStack
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes: left out of make check

BASE, OTHER = "thinkbatch-demo", "tiny-b"
# 16 sequences at 10 ms a step and 60-token answers: a wave of items lasts ~0.6 s, so a job of
# a hundred-odd items lasts a few seconds and a kill lands mid-job.
ENGINE_ENV = {
    "THINKBATCH_ENGINE": "fake",
    "THINKBATCH_MAX_NUM_SEQS": "16",
    "THINKBATCH_ENGINE_EXTRA_ARGS": '{"step_s": 0.01}',
}
PARAMS = {"ignore_eos": True, "max_tokens": 60}
MSG = [{"role": "user", "content": "Which model am I?"}]


class Models:
    def __init__(self, running: RunningStack):
        self.running = running
        self.stack: Stack = running.stack
        self.db = running.db
        self.key = running.key()
        self.starts = 0
        self.workers = {m: self.start(m) for m in (BASE, OTHER)}

    def start(self, model: str) -> Proc:
        self.starts += 1
        return self.stack.start_worker(
            f"{model}-{self.starts}", env={"THINKBATCH_SERVED_MODEL_NAME": model}
        )


@pytest.fixture(scope="module")
def models(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Models]:
    with running_stack(
        servers,
        tmp_path_factory.mktemp("models"),
        "models_stack",
        workers=(),
        THINKBATCH_SERVED_MODELS=json.dumps([BASE, OTHER]),
        **ENGINE_ENV,
        **FAST_RECOVERY_ENV,
    ) as running:
        yield Models(running)


@pytest.fixture
def client(models: Models) -> Iterator[Client]:
    assert models.running.api is not None
    with Client(models.running.api.port, models.key) as c:
        yield c


def mixed(n: int, prefix: str = "i") -> list[dict[str, Any]]:
    """Every third item on OTHER, the rest on the job's model (BASE, the item's model NULL)."""
    return [
        {"custom_id": f"{prefix}{k}", "messages": MSG, **({"model": OTHER} if k % 3 == 0 else {})}
        for k in range(n)
    ]


def ran_on(db: sa.Engine, job_id: str) -> list[tuple[str, str]]:
    """(model asked, model of the worker that stored the result) of every result of the job."""
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT coalesce(i.model, j.model), w.model FROM item_results r"
                " JOIN items i ON i.id = r.item_id JOIN jobs j ON j.id = i.job_id"
                " JOIN workers w ON w.id = r.worker_id WHERE r.job_id = :id"
            ),
            {"id": job_id},
        ).all()
    return [(asked, served) for asked, served in rows]


def check_routed(db: sa.Engine, job_id: str, n: int) -> None:
    check_invariants(db, uuid.UUID(job_id))
    assert lost_and_duplicated(db, job_id) == (0, 0)
    ran = ran_on(db, job_id)
    assert len(ran) == n
    assert [r for r in ran if r[0] != r[1]] == []  # 0 on the wrong model
    assert {served for _, served in ran} == {BASE, OTHER}


def test_a_mixed_job_runs_each_item_on_a_worker_of_its_model(
    models: Models, client: Client
) -> None:
    job = client.submit(mixed(90), model=BASE, params=PARAMS)
    done = client.wait(job["id"], timeout=120)
    assert done["status"] == "completed" and done["counts"]["succeeded"] == 90
    check_routed(models.db, job["id"], 90)
    by_id = {item["custom_id"]: item for item in client.all_items(job["id"])}
    assert by_id["i0"]["model"] == OTHER and by_id["i1"]["model"] in (None, BASE)


def test_a_mixed_batch_through_the_sdk_runs_each_line_on_its_model(models: Models) -> None:
    assert models.running.api is not None
    sdk = OpenAI(
        base_url=models.running.base_url + "/v1",
        api_key=models.key,
        max_retries=0,
        _strict_response_validation=True,
    )
    try:
        lines = [
            {"custom_id": f"c{k}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": OTHER if k % 2 else BASE, "messages": MSG,
                      "max_completion_tokens": 40}}
            for k in range(40)
        ]  # fmt: skip
        data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
        batch = sdk.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        deadline = time.monotonic() + 120
        while batch.status not in ("completed", "failed", "expired", "cancelled"):
            assert time.monotonic() < deadline, batch
            time.sleep(0.2)
            batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert counts is not None and (counts.total, counts.completed, counts.failed) == (40, 40, 0)
        assert batch.output_file_id is not None
        out = [json.loads(x) for x in sdk.files.content(batch.output_file_id).content.splitlines()]
        answered = {
            x["custom_id"]: ChatCompletion.model_validate(x["response"]["body"]).model for x in out
        }
        assert answered == {f"c{k}": OTHER if k % 2 else BASE for k in range(40)}
    finally:
        sdk.close()
    check_routed(models.db, batch.id.removeprefix("batch_"), 40)


def held_by(db: sa.Engine, job_id: str, proc: Proc) -> tuple[int, int]:
    """(items the worker process holds now, results it stored) in the job."""
    with db.connect() as conn:
        return tuple(  # type: ignore[return-value]
            conn.execute(
                sa.text(
                    "SELECT (SELECT count(*) FROM items WHERE job_id = :id AND status = 'running'"
                    "        AND lease_owner LIKE :w),"
                    "       (SELECT count(*) FROM item_results WHERE job_id = :id"
                    "        AND worker_id LIKE :w)"
                ),
                {"id": job_id, "w": f"%:{proc.pid}:%"},
            ).one()
        )


@pytest.mark.parametrize("killed", [BASE, OTHER])
def test_a_worker_killed_mid_job_and_restarted_keeps_every_item_on_its_model(
    models: Models, client: Client, killed: str
) -> None:
    n = 150
    job = client.submit(mixed(n, prefix=f"k-{killed}-"), model=BASE, params=PARAMS)
    victim = models.workers[killed]
    deadline = time.monotonic() + 60
    while True:  # it has stored results and holds more when it dies
        held, stored = held_by(models.db, job["id"], victim)
        if held > 0 and stored > 0:
            break
        assert time.monotonic() < deadline, (held, stored)
        time.sleep(0.05)
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(10)
    models.workers[killed] = models.start(killed)
    done = client.wait(job["id"], timeout=120)
    # Its released items reach the restarted worker by a re-hint in the pass that released
    # them, not when the other model's worker ends its slice (it lets the job go at once).
    assert time.monotonic() - killed_at < float(FAST_RECOVERY_ENV["THINKBATCH_TASK_SLICE_S"])
    assert done["status"] == "completed" and done["counts"]["succeeded"] == n
    check_routed(models.db, job["id"], n)
    with models.db.connect() as conn:
        workers = conn.execute(
            sa.text(
                "SELECT w.model, count(DISTINCT r.worker_id) FROM item_results r"
                " JOIN workers w ON w.id = r.worker_id WHERE r.job_id = :id GROUP BY w.model"
            ),
            {"id": job["id"]},
        ).all()
    # The killed model's items were run by the worker before the kill and the one after it.
    assert dict(workers)[killed] == 2


def test_a_worker_whose_adapter_is_named_like_another_base_model_refuses_to_start(
    models: Models, client: Client
) -> None:
    # A worker of a third base model serving an adapter named like BASE would take BASE's
    # items and run them on its own weights.
    before = {m: w.pid for m, w in models.workers.items()}
    proc = models.stack.start_worker(
        "clash",
        env={
            "THINKBATCH_SERVED_MODEL_NAME": "tiny-c",
            "THINKBATCH_LORA_ADAPTERS": json.dumps({BASE: "/adapters/not-read"}),
        },
        wait=False,
    )
    assert proc.wait(60) == 2
    log = proc.log_text()
    assert "refusing to start, served names taken" in log and repr(BASE) in log
    assert "ready." not in log
    with models.db.connect() as conn:
        assert (
            conn.execute(sa.text("SELECT count(*) FROM workers WHERE model = 'tiny-c'")).scalar()
            == 0
        )
    # The fleet goes on as before: a mixed job still runs every item on its own model.
    assert {m: w.pid for m, w in models.workers.items() if w.alive()} == before
    job = client.submit(mixed(30, prefix="after-clash-"), model=BASE, params=PARAMS)
    assert client.wait(job["id"], timeout=120)["counts"]["succeeded"] == 30
    check_routed(models.db, job["id"], 30)
