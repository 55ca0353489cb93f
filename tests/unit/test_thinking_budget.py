"""thinking_budget: validated at submit against the item's effective max_tokens, ignored with
thinking off, honoured by the fake engine, and `thinking_truncated` set when it forced the close.
The same on vLLM's CPU engine with the demo model: tests/e2e/test_reasoning_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

from tests.helpers import make_settings
from tests.helpers import submit_job
from tests.runner_harness import Harness
from tests.runner_harness import wait_status
from thinkbatch.sampling import resolve_sampling
from thinkbatch.thinking import ThinkingSplit

MSG = [{"role": "user", "content": "hi"}]


def _item(**params: Any) -> dict[str, Any]:
    item: dict[str, Any] = {"messages": MSG}
    if params:
        item["params"] = params
    return item


# (name, body, param named by the 400) — default max_tokens is 4096 (DEFAULT_MAX_TOKENS).
REFUSED = [
    ("job budget at job max_tokens", {"params": {"thinking_budget": 64, "max_tokens": 64},
     "items": [_item()]}, "params.thinking_budget"),
    ("job budget at the default", {"params": {"thinking_budget": 4096}, "items": [_item()]},
     "params.thinking_budget"),
    ("item budget above item max_tokens", {"items": [_item(), _item(thinking_budget=9,
     max_tokens=8)]}, "items[1].params.thinking_budget"),
    ("item budget above job max_tokens", {"params": {"max_tokens": 32},
     "items": [_item(), _item(thinking_budget=32)]}, "items[1].params.thinking_budget"),
    ("job budget above one item's max_tokens", {"params": {"thinking_budget": 100},
     "items": [_item(max_tokens=500), _item(max_tokens=50), _item()]}, "params.thinking_budget"),
    ("item turns thinking on under a job budget too large",
     {"params": {"thinking_budget": 10, "max_tokens": 10, "enable_thinking": False},
      "items": [_item(), _item(enable_thinking=True)]}, "params.thinking_budget"),
    ("zero", {"params": {"thinking_budget": 0}, "items": [_item()]}, "params.thinking_budget",
     "greater than or equal to 1"),
    ("float", {"items": [_item(thinking_budget=4.5)]}, "items[0].params.thinking_budget",
     "valid integer"),
    ("string", {"items": [_item(thinking_budget="4")]}, "items[0].params.thinking_budget",
     "valid integer"),
    ("huge", {"items": [_item(thinking_budget=2**64)]}, "items[0].params.thinking_budget",
     "an integer >= 1"),
]  # fmt: skip


@pytest.mark.parametrize("case", REFUSED, ids=[c[0] for c in REFUSED])
def test_a_budget_without_room_to_answer_is_a_400_naming_it(
    client: FlaskClient, db: sa.Engine, case: tuple[Any, ...]
) -> None:
    _, body, param, *rest = case
    message = rest[0] if rest else "must be below max_tokens"
    response = client.post("/v1/jobs", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 400, response.json
    error = response.json["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param)
    assert message in error["message"], error
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar() == 0


def test_the_job_params_may_follow_the_items_in_the_body(
    client: FlaskClient, db: sa.Engine
) -> None:
    body = (
        b'{"items": [{"prompt": "x", "params": {"max_tokens": 8}}],'
        b' "params": {"thinking_budget": 8}}'
    )
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert response.status_code == 400
    assert response.json["error"]["param"] == "params.thinking_budget"
    assert "items[0]" in response.json["error"]["message"]


ACCEPTED = [
    ("below max_tokens", {"params": {"thinking_budget": 63, "max_tokens": 64}, "items": [_item()]}),
    ("ignored with thinking off", {"params": {"thinking_budget": 9000, "enable_thinking": False},
     "items": [_item()]}),
    ("item thinking off", {"params": {"thinking_budget": 50, "max_tokens": 60},
     "items": [_item(max_tokens=10, enable_thinking=False)]}),
    ("item raises max_tokens", {"params": {"thinking_budget": 100, "max_tokens": 50},
     "items": [_item(max_tokens=200)]}),
    ("item lowers the budget", {"params": {"thinking_budget": 100, "max_tokens": 50},
     "items": [_item(thinking_budget=10)]}),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_budgets_that_leave_room_are_accepted(
    client: FlaskClient, db: sa.Engine, name: str, body: dict[str, Any]
) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 201, response.json


def test_the_budget_is_dropped_with_thinking_off() -> None:
    on = resolve_sampling({"thinking_budget": 8}, None, default_max_tokens=64)
    off = resolve_sampling(
        {"thinking_budget": 8}, {"enable_thinking": False}, default_max_tokens=64
    )
    assert (on.thinking_budget, off.thinking_budget) == (8, None)


@pytest.mark.parametrize(
    ("split", "reasoning", "budget", "expected"),
    [
        (ThinkingSplit("t", "", truncated=True), 20, None, True),  # cut by max_tokens
        (ThinkingSplit("t", "a", truncated=False), 5, None, False),
        (ThinkingSplit("t", "a", truncated=False), 17, 16, True),  # closed by the budget
        (ThinkingSplit("t", "a", truncated=False), 9, 16, False),  # closed by the model
    ],
)
def test_how_thinking_truncated_is_decided(
    split: ThinkingSplit, reasoning: int, budget: int | None, expected: bool
) -> None:
    from thinkbatch.thinking import thinking_truncated

    assert thinking_truncated(split, reasoning_tokens=reasoning, budget=budget) is expected


# --- the fake engine through the runner -----------------------------------------------------


@pytest.fixture
def harness(database_url: str, redis_url: str, db: sa.Engine) -> Iterator[Harness]:
    h = Harness(make_settings(database_url, redis_url, engine_extra_args={"step_s": 0.002}), db)
    yield h
    h.close()


def test_the_fake_engine_honours_the_budget(harness: Harness) -> None:
    items = [
        {"custom_id": "b4", "messages": MSG, "params": {"thinking_budget": 4}},
        {"custom_id": "b16", "messages": MSG, "params": {"thinking_budget": 16}},
        {"custom_id": "none", "messages": MSG},
        {"custom_id": "roomy", "messages": MSG, "params": {"thinking_budget": 500}},
        # Thinks past max_tokens without a budget; answers with one.
        {"custom_id": "cut", "messages": MSG, "params": {"max_tokens": 12}},
        {"custom_id": "cut-b", "messages": MSG, "params": {"max_tokens": 30, "thinking_budget": 4}},
        {"custom_id": "off", "messages": MSG, "params": {"enable_thinking": False}},
    ]
    job_id = _submit(harness, {"items": items})
    runner = harness.runner()
    thread, _ = harness.drive(runner, job_id)
    thread.join(30)
    assert wait_status(harness.db, job_id, {"completed"}).succeeded == len(items)
    got = _results(harness, job_id)
    for name, budget in (("b4", 4), ("b16", 16)):
        assert got[name]["usage"]["reasoning_tokens"] == budget + 1
        assert got[name]["answer"] and got[name]["thinking_truncated"] is True
    for name in ("none", "roomy", "off"):
        assert got[name]["answer"] and got[name]["thinking_truncated"] is False
    assert got["cut"]["answer"] == "" and got["cut"]["thinking_truncated"] is True
    assert got["cut-b"]["answer"] and got["cut-b"]["thinking_truncated"] is True
    assert got["none"]["usage"]["reasoning_tokens"] > 17


def _submit(harness: Harness, body: dict[str, Any]) -> Any:
    return submit_job(harness.db, harness.settings, body)


def _results(harness: Harness, job_id: Any) -> dict[str, dict[str, Any]]:
    from tests.helpers import job_records

    return job_records(harness.db, harness.settings, job_id)
