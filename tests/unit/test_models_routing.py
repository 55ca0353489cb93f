"""Many models on one service, on the fake engine: each item runs on a worker of the model it
names, claims take only the items of a worker's models, hints go to each model's queue, a job
for a configured model with no live worker waits visibly and runs when one starts, and an
unknown model is refused naming what is served."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import TENANT
from tests.helpers import job_records
from tests.helpers import keyed_client
from tests.helpers import make_key
from tests.helpers import make_settings
from tests.helpers import submit_job
from tests.runner_harness import Harness
from tests.runner_harness import wait_status
from thinkbatch import ledger
from thinkbatch.jobs.fleet import LiveWorkers
from thinkbatch.ledger import ModelFilter
from thinkbatch.queue import model_queue
from thinkbatch.settings import Settings
from thinkbatch.sweeper import sweep

BASE, OTHER = "thinkbatch-demo", "tiny-b"
MSG = [{"role": "user", "content": "Which model am I?"}]


def mixed(n: int = 12) -> dict[str, Any]:
    """Every third item on OTHER, the rest on the job's model (BASE)."""
    items = [
        {"custom_id": f"i{k}", "messages": MSG, **({"model": OTHER} if k % 3 == 0 else {})}
        for k in range(n)
    ]
    return {"model": BASE, "items": items}


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    return make_settings(database_url, redis_url, served_models=[BASE, OTHER])


@pytest.fixture
def harness(settings: Settings, db: sa.Engine) -> Iterator[Harness]:
    h = Harness(settings.model_copy(update={"engine_extra_args": {"step_s": 0.001}}), db)
    yield h
    h.close()


def register(db: sa.Engine, owner: str, model: str, adapters: list[str] | None = None) -> None:
    with db.begin() as conn:
        ledger.register_worker(
            conn, owner, hostname="h", pid=1, model=model, adapters=adapters, dead_after_s=60
        )


def claim_as(
    db: sa.Engine, job_id: uuid.UUID, served: list[str], owner: str = "w"
) -> list[ledger.Claimed]:
    with db.begin() as conn:
        row = ledger.job_to_drive(conn, job_id)
        assert row is not None
        models = ModelFilter.of(row.model, row.models, served)
        return ledger.claim(conn, job_id, owner=owner, n=100, lease_s=60, models=models)


def test_claims_take_only_the_items_of_the_models_served(db: sa.Engine, settings: Settings) -> None:
    job_id = submit_job(db, settings, mixed())
    with db.connect() as conn:
        models = conn.execute(sa.text("SELECT models FROM jobs WHERE id = :id"), {"id": job_id})
        assert models.scalar() == [BASE, OTHER]
    other = claim_as(db, job_id, [OTHER, "unrelated"])
    assert sorted(c.seq for c in other) == [0, 3, 6, 9]
    assert {c.model for c in other} == {OTHER}
    base = claim_as(db, job_id, [BASE])
    assert sorted(c.seq for c in base) == [1, 2, 4, 5, 7, 8, 10, 11]
    assert {c.model for c in base} == {None}  # the job's own: the runner names it
    assert claim_as(db, job_id, ["nobody"]) == []


def test_claims_of_one_item_take_turns_between_the_served_names(
    db: sa.Engine, settings: Settings
) -> None:
    job_id = submit_job(db, settings, mixed(24))  # 8 items on OTHER, 16 on BASE
    models = []
    for turn in range(8):
        with db.begin() as conn:
            row = ledger.job_to_drive(conn, job_id)
            assert row is not None
            served = ModelFilter.of(row.model, row.models, [BASE, OTHER])
            (one,) = ledger.claim(
                conn, job_id, owner="w", n=1, lease_s=60, models=served, turn=turn
            )
        models.append(one.model or BASE)
    # Without turns every claim of one item would go to the first name until it ran out.
    assert models == [BASE, OTHER] * 4


def test_each_item_runs_on_a_worker_of_its_model(harness: Harness) -> None:
    job_id = submit_job(harness.db, harness.settings, mixed(30))
    runners = [
        harness.runner(served_model_name=BASE),
        harness.runner(served_model_name=OTHER),
    ]
    threads = [harness.drive(r, job_id)[0] for r in runners]
    for thread in threads:
        thread.join(30)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == 30
    with harness.db.connect() as conn:
        ran = conn.execute(
            sa.text(
                "SELECT coalesce(i.model, j.model) AS asked, w.model AS served "
                "FROM item_results r JOIN items i ON i.id = r.item_id "
                "JOIN jobs j ON j.id = i.job_id JOIN workers w ON w.id = r.worker_id"
            )
        ).all()
    assert len(ran) == 30
    assert [r for r in ran if r.asked != r.served] == []  # 0 on the wrong model
    assert {r.served for r in ran} == {BASE, OTHER}
    records = job_records(harness.db, harness.settings, job_id)
    assert records["i0"]["model"] == OTHER and records["i1"]["model"] == BASE


def test_a_worker_drops_a_hint_for_a_job_of_other_models(harness: Harness) -> None:
    job_id = submit_job(
        harness.db, harness.settings, {"model": OTHER, "items": mixed()["items"][:1]}
    )
    runner = harness.runner(served_model_name=BASE)
    thread, reports = harness.drive(runner, job_id)
    thread.join(10)
    assert reports[0]["outcome"] == "not runnable here"
    with harness.db.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :id"), {"id": job_id})
        assert status.scalar() == "queued"  # not failed: it waits for a worker of its model


def test_hints_go_to_each_models_queue(client: FlaskClient, settings: Settings) -> None:
    job_id = client.post("/v1/jobs", json=mixed()).json["id"]
    with redis.Redis.from_url(settings.require_redis_url()) as broker:
        for model in (BASE, OTHER):
            messages = [json.loads(m) for m in broker.lrange(model_queue(settings, model), 0, -1)]
            assert [m["headers"]["argsrepr"] for m in messages] == [repr([job_id])], model


def test_a_configured_model_without_a_worker_waits_visibly(
    client: FlaskClient, db: sa.Engine, settings: Settings
) -> None:
    register(db, "w-base", BASE)
    job = client.post("/v1/jobs", json=mixed()).json
    assert job["waiting_for"] == [OTHER]
    status = client.get(f"/v1/jobs/{job['id']}").json
    assert status["waiting_for"] == [OTHER]
    listed = client.get("/v1/jobs").json["data"][0]
    assert listed["waiting_for"] == [OTHER]
    # Once its items of that model are done, the job waits for it no more.
    with db.begin() as conn:
        conn.execute(
            sa.text("UPDATE items SET status = 'cancelled' WHERE model = :m"), {"m": OTHER}
        )
    assert client.get(f"/v1/jobs/{job['id']}").json["waiting_for"] == []


def test_polls_see_the_fleet_at_most_their_ttl_late(db: sa.Engine, settings: Settings) -> None:
    live = LiveWorkers(settings.worker_dead_after_s, ttl_s=0.5)
    with db.connect() as conn:
        assert live.get(conn) == {}
        register(db, "w-late", BASE)
        assert live.get(conn) == {}  # read less than the ttl ago: not asked again
        time.sleep(0.6)
        assert live.get(conn) == {BASE: 1}


def test_an_unknown_model_is_refused_naming_what_is_served(
    client: FlaskClient, db: sa.Engine
) -> None:
    register(db, "w-live", "live-only", adapters=["live-adapter"])
    for body, param in (
        ({"model": "nope", "items": [{"prompt": "x"}]}, "model"),
        ({"items": [{"prompt": "x"}, {"prompt": "y", "model": "nope"}]}, "items[1].model"),
    ):
        error = client.post("/v1/jobs", json=body).json["error"]
        assert (error["code"], error["param"]) == ("model_not_found", param)
        for served in (BASE, OTHER, "live-only", "live-adapter"):
            assert repr(served) in error["message"]
    # A name only a live worker serves (an adapter) is accepted.
    made = client.post("/v1/jobs", json={"items": [{"prompt": "x", "model": "live-adapter"}]})
    assert made.status_code == 201 and made.json["model"] == "live-adapter"


def test_models_lists_every_served_name_with_its_live_workers(
    client: FlaskClient, db: sa.Engine
) -> None:
    register(db, "w1", BASE, adapters=["lora-a"])
    register(db, "w2", BASE)
    data = {m["id"]: m for m in client.get("/v1/models").json["data"]}
    assert (data[BASE]["workers"], data[OTHER]["workers"], data["lora-a"]["workers"]) == (2, 0, 1)
    assert data["lora-a"]["parent"] == BASE and data[BASE]["parent"] is None
    assert data[OTHER]["created"] is None


def test_the_sweeper_rehints_only_models_with_a_live_worker(
    db: sa.Engine, settings: Settings
) -> None:
    waiting = submit_job(db, settings, {"model": OTHER, "items": [{"prompt": "x"}]})
    served = submit_job(db, settings, {"items": [{"prompt": "x"}]})
    register(db, "w-base", BASE)
    published: list[uuid.UUID] = []
    sweep(db, settings, publish=lambda j: published.append(j) or True)
    assert published == [served]  # the other waits: nobody serves its model yet
    register(db, "w-other", OTHER)
    with db.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET hinted_at = NULL"))
    published.clear()
    sweep(db, settings, publish=lambda j: published.append(j) or True)
    assert set(published) == {waiting, served}


def test_an_idle_worker_adopts_a_waiting_job_of_its_model(
    db: sa.Engine, settings: Settings
) -> None:
    waiting = submit_job(db, settings, {"model": OTHER, "items": [{"prompt": "x"}]})
    with db.connect() as conn:
        assert ledger.job_to_adopt(conn, models=[BASE], exclude=[]) is None
        assert ledger.job_to_adopt(conn, models=[OTHER], exclude=[]) == waiting


def test_a_mixed_batch_file_runs_each_line_on_its_model(
    make_app: Callable[..., Flask], db: sa.Engine, harness: Harness
) -> None:
    client = keyed_client(make_app(), make_key(db, TENANT))
    lines = [
        {"custom_id": f"c{k}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": OTHER if k % 2 else BASE, "messages": MSG}}
        for k in range(6)
    ]  # fmt: skip
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    from io import BytesIO

    file_id = client.post(
        "/v1/files", data={"purpose": "batch", "file": (BytesIO(data), "in.jsonl")}
    ).json["id"]
    batch = client.post(
        "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
              "completion_window": "24h"},
    ).json  # fmt: skip
    job_id = uuid.UUID(batch["id"].removeprefix("batch_"))
    threads = [harness.drive(harness.runner(served_model_name=m), job_id)[0] for m in (BASE, OTHER)]
    for thread in threads:
        thread.join(30)
    assert wait_status(db, job_id, {"completed"}).succeeded == 6
    done = client.get(f"/v1/batches/{batch['id']}").json
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    records = job_records(db, harness.settings, job_id)
    assert {cid: r["model"] for cid, r in records.items()} == {
        f"c{k}": OTHER if k % 2 else BASE for k in range(6)
    }


def test_metrics_and_the_dashboard_show_the_work_by_model(
    app: Flask, client: FlaskClient, db: sa.Engine
) -> None:
    register(db, "w-base", BASE)
    client.post("/v1/jobs", json=mixed())
    text = client.get("/metrics").get_data(as_text=True)
    assert f'thinkbatch_items{{model="{OTHER}",status="pending"}} 4.0' in text
    assert f'thinkbatch_items{{model="{BASE}",status="pending"}} 8.0' in text
    assert f'thinkbatch_model_live_workers{{model="{OTHER}"}} 0.0' in text
    assert f'thinkbatch_model_live_workers{{model="{BASE}"}} 1.0' in text
    browser = app.test_client()
    browser.post("/login", data={"key": make_key(db, TENANT)})
    page = browser.get("/").get_data(as_text=True)
    assert f'data-model="{OTHER}"' in page and f"waits for {OTHER}" in page


def test_a_worker_stops_driving_a_job_when_only_other_models_items_are_left(
    harness: Harness,
) -> None:
    # Nobody serves OTHER: BASE's worker runs its own items, then lets the job go instead of
    # driving it (claiming nothing) until its slice ends, and sends no hint that would come
    # straight back to it.
    job_id = submit_job(harness.db, harness.settings, mixed(12))
    thread, reports = harness.drive(harness.runner(served_model_name=BASE), job_id)
    thread.join(15)
    assert not thread.is_alive()
    assert reports[-1]["pending"] == 4 and harness.published == []
    row = wait_status(harness.db, job_id, {"running"})
    assert (row.succeeded, row.pending) == (8, 4)


def test_released_items_have_their_job_hinted_again(db: sa.Engine, settings: Settings) -> None:
    # The job may look alive (driven by a worker of another model): the sweeper re-hints it
    # anyway in the pass that released the items, for the live workers of their model.
    job_id = submit_job(db, settings, mixed())
    register(db, "w-other", OTHER)
    assert len(claim_as(db, job_id, [OTHER], owner="w-other")) == 4
    with db.begin() as conn:
        ledger.mark_hinted(conn, job_id)
        released = ledger.release_crashed(
            conn, "w-other", max_attempts=3, code="worker_lost", message="gone"
        )
        assert released == 4
        assert ledger.stale_jobs(conn, stale_s=3600, models=[OTHER]) == [job_id]


# slow: fairness needs tenant A's big job still running seconds after B's small jobs finished
# (as test_runner's test_a_small_job_is_not_starved_by_a_big_one); ~8 s of engine time.
@pytest.mark.slow
def test_a_tenant_flooding_one_model_starves_no_one_on_either_model(harness: Harness) -> None:
    # Tenant A floods BASE with a big job; tenant B's small jobs, one on BASE and one on OTHER,
    # both finish while A's is still far from done: on BASE's worker B gets its tenant's share
    # of the engine at once, and OTHER's worker is not held up by A's job at all.
    slow = {"engine_extra_args": {"step_s": 0.004}}
    base = harness.runner(served_model_name=BASE, **slow)
    other = harness.runner(served_model_name=OTHER, **slow)
    big = submit_job(
        harness.db,
        harness.settings,
        {"model": BASE, "items": [{"prompt": f"flood {k}"} for k in range(1500)]},
        tenant="tenant-a",
    )
    big_thread, _ = harness.drive(base, big)
    wait_status(harness.db, big, {"running"})
    small = {
        model: submit_job(
            harness.db,
            harness.settings,
            {"model": model, "items": [{"prompt": f"small {k}"} for k in range(40)]},
            tenant="tenant-b",
        )
        for model in (BASE, OTHER)
    }
    threads = [harness.drive(runner, small[m])[0] for m, runner in ((BASE, base), (OTHER, other))]
    for thread in threads:
        thread.join(60)
    for job_id in small.values():
        assert wait_status(harness.db, job_id, {"completed"}, timeout=5).succeeded == 40
    flood = wait_status(harness.db, big, {"running"})
    assert flood.pending > 500, flood.pending  # B did not wait behind A on either model
    big_thread.join(120)
    assert wait_status(harness.db, big, {"completed"}).succeeded == 1500
    with harness.db.connect() as conn:
        wrong = conn.execute(
            sa.text(
                "SELECT count(*) FROM item_results r JOIN items i ON i.id = r.item_id"
                " JOIN jobs j ON j.id = i.job_id JOIN workers w ON w.id = r.worker_id"
                " WHERE w.model <> coalesce(i.model, j.model)"
            )
        ).scalar_one()
    assert wrong == 0


def test_a_waiting_job_still_expires(db: sa.Engine, settings: Settings) -> None:
    job_id = submit_job(db, settings, {"model": OTHER, "completion_window": 1,
                                       "items": [{"prompt": "x"}]})  # fmt: skip
    with db.begin() as conn:  # its window has passed while no worker of its model lived
        conn.execute(
            sa.text("UPDATE jobs SET expires_at = now() - interval '1 s' WHERE id = :id"),
            {"id": job_id},
        )
    sweep(db, settings, publish=lambda j: True)
    assert wait_status(db, job_id, {"expired"}).expired == 1
