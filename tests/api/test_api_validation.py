"""Bad input: a 400 that names the field, and nothing stored. Unknown ids: 404."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

GOOD_ITEM = {"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]}


def job(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"items": [GOOD_ITEM]}
    body.update(overrides)
    return body


CASES: list[tuple[str, bytes | dict[str, Any], str | None, str]] = [
    ("not json", b"{items: [", None, "not valid JSON"),
    ("empty body", b"", None, "request body is empty"),
    ("json but not an object", b"[1, 2]", None, "should be an object"),
    ("missing items", {"params": {}}, "items", "Field required"),
    ("empty items", {"items": []}, "items", "at least 1 item"),
    ("items not a list", {"items": {"a": 1}}, "items", "valid array"),
    (
        "both messages and prompt",
        {"items": [{**GOOD_ITEM, "prompt": "x"}]},
        "items[0]",
        "exactly one of 'messages' or 'prompt'",
    ),
    ("neither messages nor prompt", {"items": [{"custom_id": "a"}]}, "items[0]", "exactly one"),
    (
        "unknown role",
        {"items": [GOOD_ITEM, {"messages": [{"role": "robot", "content": "x"}]}]},
        "items[1].messages[0].role",
        "'system', 'user', 'assistant' or 'tool'",
    ),
    (
        "non-string content",
        {"items": [{"messages": [{"role": "user", "content": 42}]}]},
        "items[0].messages[0].content",
        "valid string",
    ),
    (
        "empty messages",
        {"items": [{"messages": []}]},
        "items[0].messages",
        "at least 1 item",
    ),
    (
        "duplicate custom_id",
        {"items": [GOOD_ITEM, {"custom_id": "b", "prompt": "x"}, {**GOOD_ITEM}]},
        "items[2].custom_id",
        "duplicate custom_id 'a'",
    ),
    (
        "max_tokens zero",
        job(params={"max_tokens": 0}),
        "params.max_tokens",
        "greater than or equal to 1",
    ),
    (
        "max_tokens negative",
        job(params={"max_tokens": -5}),
        "params.max_tokens",
        "greater than or equal to 1",
    ),
    (
        "max_tokens above the cap",
        {"items": [{**GOOD_ITEM, "params": {"max_tokens": 10**7}}]},
        "items[0].params.max_tokens",
        "above the cap",
    ),
    (
        "negative temperature",
        job(params={"temperature": -0.1}),
        "params.temperature",
        "greater than or equal to 0",
    ),
    ("top_p zero", job(params={"top_p": 0}), "params.top_p", "greater than 0"),
    ("top_p above one", job(params={"top_p": 1.01}), "params.top_p", "less than or equal to 1"),
    ("string number", job(params={"max_tokens": "5"}), "params.max_tokens", "valid integer"),
    ("unknown param", job(params={"temprature": 1}), "params.temprature", "Extra inputs"),
    ("unknown top-level field", job(colour="red"), "colour", "Extra inputs"),
    ("unknown model", job(model="gpt-9"), "model", "unknown model 'gpt-9'"),
    ("metadata not strings", job(metadata={"a": 1}), "metadata.a", "valid string"),
    ("priority out of range", job(priority=12), "priority", "less than or equal to 9"),
]


@pytest.mark.parametrize(("name", "body", "param", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_400_naming_the_field(
    client: FlaskClient,
    db: sa.Engine,
    name: str,
    body: bytes | dict[str, Any],
    param: str | None,
    message: str,
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = client.post("/v1/jobs", data=data, content_type="application/json")
    assert response.status_code == 400, response.json
    error = response.json["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"]
    if param:
        assert error["message"].startswith(param)  # the message names the field too
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar() == 0


def test_too_many_items(client: FlaskClient, db: sa.Engine, app) -> None:
    limit = app.extensions["thinkbatch"].settings.max_items_per_job
    items = [{"prompt": "x"}] * (limit + 1)
    response = client.post("/v1/jobs", json={"items": items})
    assert response.status_code == 400
    assert response.json["error"]["param"] == "items"


def test_body_over_the_size_limit_is_413(make_app, db: sa.Engine) -> None:
    from tests.helpers import keyed_client
    from tests.helpers import make_key

    client = keyed_client(make_app(max_request_bytes=2048), make_key(db, "acme"))
    response = client.post("/v1/jobs", json={"items": [{"prompt": "x" * 5000}]})
    assert response.status_code == 413
    assert response.json["error"]["code"] == "request_entity_too_large"


@pytest.mark.parametrize(
    "path",
    [
        "/v1/jobs/00000000-0000-0000-0000-000000000000",
        "/v1/jobs/not-a-uuid",
        "/v1/jobs/00000000-0000-0000-0000-000000000000/items",
        "/v1/jobs/00000000-0000-0000-0000-000000000000/results",
    ],
)
def test_unknown_job_is_404(client: FlaskClient, db: sa.Engine, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert response.json["error"]["type"] == "not_found"


def test_cancel_unknown_job_is_404(client: FlaskClient, db: sa.Engine) -> None:
    assert client.post("/v1/jobs/00000000-0000-0000-0000-000000000000/cancel").status_code == 404


@pytest.mark.parametrize("query", ["limit=0", "limit=1001", "limit=x", "status=done"])
def test_bad_query_parameters(client: FlaskClient, db: sa.Engine, query: str) -> None:
    created = client.post("/v1/jobs", json=job())
    response = client.get(f"/v1/jobs/{created.json['id']}/items?{query}")
    assert response.status_code == 400
    assert response.json["error"]["param"] == query.split("=")[0]


def test_a_bad_item_late_in_a_large_job_stores_nothing(client: FlaskClient, db: sa.Engine) -> None:
    items: list[dict[str, Any]] = [{"prompt": f"p{k}"} for k in range(6000)]
    items[5500] = {"prompt": 7}
    response = client.post("/v1/jobs", json={"items": items})
    assert response.status_code == 400
    assert response.json["error"]["param"] == "items[5500].prompt"
    with db.connect() as conn:  # the 5,500 items streamed before it were rolled back
        assert conn.execute(sa.text("SELECT count(*) FROM items")).scalar() == 0
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 0


def test_a_custom_id_equal_to_a_generated_one(client: FlaskClient, db: sa.Engine) -> None:
    body = {"items": [{"prompt": "a"}, {"custom_id": "item-0", "prompt": "b"}]}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 400
    assert response.json["error"]["param"] == "items[1].custom_id"
    assert "generated for items[0]" in response.json["error"]["message"]


def test_generated_ids_avoid_earlier_custom_ids(client: FlaskClient, db: sa.Engine) -> None:
    body = {"items": [{"custom_id": "item-1", "prompt": "a"}, {"prompt": "b"}]}
    job = client.post("/v1/jobs", json=body).json
    ids = [i["custom_id"] for i in client.get(f"/v1/jobs/{job['id']}/items").json["data"]]
    assert ids == ["item-1", "item-1_"]
