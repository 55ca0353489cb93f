"""Keys, tenants and quotas at the API: nobody reads or touches what is not theirs, every route
but the probes refuses an anonymous call, and one tenant cannot starve the others."""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable

import pytest
import redis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import orm
from werkzeug.routing import Rule

from api.auth import FailureLimiter
from api.auth import TooManyFailures
from tests.helpers import keyed_client
from tests.helpers import make_key
from thinkbatch.keys import revoke_key
from thinkbatch.settings import Settings

# The only routes open to anonymous callers: the probes, metrics, and the API's own
# description (no one's data, and a browser cannot send a bearer key to open /docs). A route
# added later is protected unless it is added here *and* marked public in the code.
PUBLIC = {
    "/healthz",
    "/readyz",
    "/metrics",
    "/openapi.json",
    "/docs",
    "/docs/assets/<path:name>",
    # The dashboard's sign-in and sign-out: the form that takes a key, and dropping the cookie.
    "/login",
    "/logout",
}
# Dashboard pages: their key comes from the login cookie, and without one they send the
# browser to the login page (api.auth.browser) instead of answering 401.
BROWSER = {"/", "/jobs/<job_id>", "/jobs/<job_id>/timeline"}
JOB = {"items": [{"custom_id": "a", "prompt": "hello"}, {"custom_id": "b", "prompt": "hi"}]}


def _url(rule: Rule) -> str:
    values = {arg: str(uuid.uuid4()) for arg in rule.arguments}
    return rule.build(values, append_unknown=False)[1]  # type: ignore[index]


def _calls(app: Flask) -> list[tuple[str, str, str]]:
    calls = []
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        for method in sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}):
            calls.append((method, _url(rule), rule.rule))
    return calls


def test_every_route_but_the_probes_refuses_an_anonymous_call(
    app: Flask, anonymous: FlaskClient
) -> None:
    calls = _calls(app)
    assert len(calls) >= 6  # the URL map really was walked
    for method, url, rule in calls:
        response = anonymous.open(url, method=method, json={})
        if rule in PUBLIC:
            assert response.status_code != 401, (method, rule)
        elif rule in BROWSER:
            assert response.status_code == 303, (method, rule, response.status_code)
            assert response.headers["Location"].endswith("/login")
        else:
            assert response.status_code == 401, (method, rule, response.status_code)
            error = response.json["error"]
            assert error["type"] == "authentication_error" and error["message"]
            assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_a_route_added_later_is_protected_too(make_app: Callable[..., Flask]) -> None:
    app = make_app()

    @app.get("/v1/new-thing")
    def new_thing() -> dict[str, str]:
        return {"secret": "yes"}

    assert app.test_client().get("/v1/new-thing").status_code == 401


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "Bearer tb_00000000_" + "A" * 43,
        "Bearer not-a-key",
        "Bearer " + "x" * 10_000,
        "bearer\ttb_",
    ],
)
def test_missing_malformed_and_unknown_keys_get_401(app: Flask, header: str | None) -> None:
    client = app.test_client()
    headers = {} if header is None else {"Authorization": header}
    response = client.get("/v1/jobs", headers=headers)
    assert response.status_code == 401
    assert response.json["error"]["type"] == "authentication_error"


def test_revocation_takes_effect_on_the_next_request(app: Flask, db: sa.Engine) -> None:
    key = make_key(db, "acme")
    client = keyed_client(app, key)
    assert client.get("/v1/jobs").status_code == 200
    with orm.Session(db) as session, session.begin():
        revoke_key(session, key.split("_")[1])
    assert client.get("/v1/jobs").status_code == 401


def test_another_tenants_job_is_not_found_by_any_route(
    client: FlaskClient, rival: FlaskClient
) -> None:
    job = client.post("/v1/jobs", json=JOB).json
    job_id = job["id"]
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/items"),
        ("GET", f"/v1/jobs/{job_id}/results"),
        ("POST", f"/v1/jobs/{job_id}/cancel"),
    ]:
        theirs = rival.open(path, method=method)
        assert theirs.status_code == 404, (method, path, theirs.status_code)
        assert (
            job_id not in theirs.get_data(as_text=True)
            or "no job" in theirs.json["error"]["message"]
        )
        # ...exactly as for a job that never existed
        missing = rival.open(path.replace(job_id, str(uuid.uuid4())), method=method)
        assert missing.status_code == 404
        assert theirs.json["error"]["code"] == missing.json["error"]["code"]
    assert rival.get("/v1/jobs").json["data"] == []
    paged = rival.get("/v1/jobs", query_string={"after": job_id})
    assert paged.status_code in (400, 404) and job_id not in str(paged.json.get("data", ""))
    assert [j["id"] for j in client.get("/v1/jobs").json["data"]] == [job_id]
    # The owner's job was not cancelled by the rival's attempt.
    assert client.get(f"/v1/jobs/{job_id}").json["status"] == "queued"


def _early_in_a_minute() -> None:
    """The failure counts are per minute: a test that counts them starts early in one."""
    left = 60 - time.time() % 60
    if left < 10:
        time.sleep(left + 0.1)


def test_failed_attempts_are_rate_limited_per_address(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    _early_in_a_minute()
    app = make_app(auth_failures_per_minute=3)
    good = keyed_client(app, make_key(db, "acme"))
    bad = keyed_client(app, "tb_00000000_" + "B" * 43)
    statuses = [bad.get("/v1/jobs").status_code for _ in range(5)]
    assert statuses == [401, 401, 401, 429, 429]
    limited = bad.get("/v1/jobs")
    assert limited.json["error"]["type"] == "rate_limit_error"
    assert 1 <= int(limited.headers["Retry-After"]) <= 60
    # The limit is per address; the test client's address is shared, so a good key from the
    # same address waits too (what a brute-force guard must do).
    assert good.get("/v1/jobs").status_code == 429
    other = app.test_client()
    other.environ_base["REMOTE_ADDR"] = "127.0.0.9"
    other.environ_base["HTTP_AUTHORIZATION"] = good.environ_base["HTTP_AUTHORIZATION"]
    assert other.get("/v1/jobs").status_code == 200


def test_each_process_adds_at_most_one_failed_attempt_to_the_limit(
    make_app: Callable[..., Flask], db: sa.Engine, settings: Settings
) -> None:
    """Two apps on one Redis are two API processes. A process that saw an address clean
    skips the counter for it until a failure of its own, so failures counted elsewhere reach
    it one attempt late: at most the limit plus one attempt per process, never more."""
    _early_in_a_minute()
    first, second = make_app(auth_failures_per_minute=3), make_app(auth_failures_per_minute=3)
    key = make_key(db, "acme")
    assert keyed_client(first, key).get("/v1/jobs").status_code == 200  # seen clean in first
    bad = "tb_00000000_" + "B" * 43
    assert [keyed_client(second, bad).get("/v1/jobs").status_code for _ in range(4)] == [
        401, 401, 401, 429,
    ]  # fmt: skip
    # The first process still remembers the address as clean: one more attempt gets through
    # and is counted, and from then on it asks Redis, which says the address is over.
    assert [keyed_client(first, bad).get("/v1/jobs").status_code for _ in range(3)] == [
        401, 429, 429,
    ]  # fmt: skip
    assert keyed_client(first, key).get("/v1/jobs").status_code == 429
    with redis.Redis.from_url(settings.require_redis_url()) as client:
        counted = [int(client.get(k) or 0) for k in client.keys("thinkbatch:auth-failures:*")]
    assert counted == [4]  # 3 + 1: every failed attempt that reached a key lookup


def test_after_a_failure_of_its_own_a_process_asks_redis_for_the_rest_of_the_minute(
    settings: Settings,
) -> None:
    _early_in_a_minute()
    with redis.Redis.from_url(settings.require_redis_url()) as client:
        client.flushdb()
        limiter = FailureLimiter(client, limit=3)
        limiter.check("10.0.0.1")  # clean: remembered
        limiter.failed("10.0.0.1")
        (counter,) = client.keys("thinkbatch:auth-failures:10.0.0.1:*")
        client.delete(counter)  # as a read from before that failure would see it
        limiter.check("10.0.0.1")  # reads 0, yet does not remember the address clean
        client.set(counter, 3)  # other processes' failures
        with pytest.raises(TooManyFailures):
            limiter.check("10.0.0.1")


def test_no_key_reaches_the_logs(
    app: Flask, db: sa.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    key = make_key(db, "acme")
    caplog.set_level(logging.DEBUG)
    keyed_client(app, key).post("/v1/jobs", json=JOB)
    keyed_client(app, key + "x").get("/v1/jobs")
    secret = key.split("_", 2)[2]
    assert secret not in caplog.text


def test_auth_can_be_turned_off_for_local_use(make_app: Callable[..., Flask]) -> None:
    app = make_app(auth_required=False)
    client = app.test_client()
    job = client.post("/v1/jobs", json=JOB)
    assert job.status_code == 201
    assert client.get(f"/v1/jobs/{job.json['id']}").status_code == 200


def test_unfinished_items_quota(make_app: Callable[..., Flask], db: sa.Engine) -> None:
    app = make_app(tenant_max_unfinished_items=5)
    acme = keyed_client(app, make_key(db, "acme"))
    rival = keyed_client(app, make_key(db, "rival"))
    three = {"items": [{"prompt": f"p{i}"} for i in range(3)]}
    assert acme.post("/v1/jobs", json=three).status_code == 201
    refused = acme.post("/v1/jobs", json=three)
    assert refused.status_code == 429
    error = refused.json["error"]
    assert error["code"] == "quota_exceeded"
    assert re.search(r"\b3 unfinished\b.*\badds 3\b.*\b5\b", error["message"]), error["message"]
    assert int(refused.headers["Retry-After"]) >= 1
    # Nothing of the refused job was stored, and another tenant is not affected.
    assert len(acme.get("/v1/jobs").json["data"]) == 1
    assert rival.post("/v1/jobs", json=three).status_code == 201
    # Finished work frees the quota.
    job_id = acme.get("/v1/jobs").json["data"][0]["id"]
    assert acme.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    assert acme.post("/v1/jobs", json=three).status_code == 201


def test_submissions_per_minute(make_app: Callable[..., Flask], db: sa.Engine) -> None:
    app = make_app(tenant_jobs_per_minute=2)
    acme = keyed_client(app, make_key(db, "acme"))
    assert [acme.post("/v1/jobs", json=JOB).status_code for _ in range(3)] == [201, 201, 429]
    refused = acme.post("/v1/jobs", json=JOB)
    assert refused.json["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["Retry-After"]) <= 60
    assert keyed_client(app, make_key(db, "rival")).post("/v1/jobs", json=JOB).status_code == 201


def test_parallel_submits_cannot_overrun_the_quota(
    make_app: Callable[..., Flask], db: sa.Engine
) -> None:
    app = make_app(tenant_max_unfinished_items=10)
    key = make_key(db, "acme")
    statuses: list[int] = []
    barrier = threading.Barrier(8)

    def submit() -> None:
        client = keyed_client(app, key)
        barrier.wait()
        statuses.append(client.post("/v1/jobs", json={"items": [{"prompt": "x"}] * 3}).status_code)

    threads = [threading.Thread(target=submit) for _ in range(8)]
    run_all(threads, lambda t: t.start())
    run_all(threads, lambda t: t.join(30))
    assert sorted(statuses) == [201] * 3 + [429] * 5
    with db.connect() as conn:
        stored = conn.execute(sa.text("SELECT sum(total) FROM jobs WHERE tenant = 'acme'"))
        assert stored.scalar() == 9


def run_all(threads: list[threading.Thread], action: Callable[[threading.Thread], None]) -> None:
    for thread in threads:
        action(thread)
