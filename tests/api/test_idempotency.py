"""Submissions are idempotent for every caller: the same Idempotency-Key with the same request
answers the job it made, never a second one; with another request it is a 400."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

BODY = {"items": [{"custom_id": "a", "prompt": "hello"}], "metadata": {"run": "1"}}


def _jobs(db: sa.Engine) -> list[str]:
    with db.connect() as conn:
        return [str(i) for i in conn.execute(sa.text("SELECT id FROM jobs")).scalars()]


def test_a_retried_submit_gets_the_same_job(client: FlaskClient, db: sa.Engine) -> None:
    first = client.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": "run-1"})
    assert first.status_code == 201
    assert first.headers["Idempotent-Replayed"] == "false"
    again = client.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": "run-1"})
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json["id"] == first.json["id"]
    assert _jobs(db) == [first.json["id"]]


def test_the_same_key_with_another_body_is_a_400(client: FlaskClient, db: sa.Engine) -> None:
    first = client.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": "run-2"})
    other = {**BODY, "metadata": {"run": "2"}}
    reused = client.post("/v1/jobs", json=other, headers={"Idempotency-Key": "run-2"})
    assert reused.status_code == 400
    error = reused.json["error"]
    assert (error["param"], error["code"]) == ("Idempotency-Key", "idempotency_key_reused")
    assert _jobs(db) == [first.json["id"]]


def test_keys_are_per_tenant_and_without_a_key_each_submit_is_new(
    client: FlaskClient, rival: FlaskClient, db: sa.Engine
) -> None:
    mine = client.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": "k"}).json["id"]
    theirs = rival.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": "k"}).json["id"]
    assert mine != theirs
    a = client.post("/v1/jobs", json=BODY).json["id"]
    b = client.post("/v1/jobs", json=BODY).json["id"]
    assert len({mine, theirs, a, b}) == 4


@pytest.mark.parametrize("key", ["", "a b", "é", "x" * 256])
def test_a_malformed_key_is_a_400(client: FlaskClient, db: sa.Engine, key: str) -> None:
    response = client.post("/v1/jobs", json=BODY, headers={"Idempotency-Key": key})
    assert response.status_code == 400
    assert response.json["error"]["param"] == "Idempotency-Key"
    assert _jobs(db) == []
