"""The dashboard's pages in-process: sign-in by cookie, tenant scoping, what each page shows."""

from __future__ import annotations

import io
import json
import logging

import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient

from tests.helpers import TENANT
from tests.helpers import make_key
from tests.helpers import seed_job
from thinkbatch import logging_setup
from thinkbatch.settings import Settings
from worker.progress import ProgressReporter


def _signed_in(app: Flask, key: str) -> FlaskClient:
    browser = app.test_client()
    response = browser.post("/login", data={"key": key})
    assert response.status_code == 303 and response.headers["Location"] == "/"
    cookie = response.headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie and "Path=/" in cookie
    return browser


def test_sign_in_shows_the_tenants_jobs_only(app: Flask, db: sa.Engine, settings: Settings) -> None:
    mine = seed_job(db, settings, 3)
    theirs = seed_job(db, settings, 2, tenant="rival")
    browser = _signed_in(app, make_key(db, TENANT))
    page = browser.get("/")
    assert page.status_code == 200
    html = page.get_data(as_text=True)
    assert f'data-job="{mine}"' in html and f'data-job="{theirs}"' not in html
    assert "script-src" not in page.headers["Content-Security-Policy"]  # no script at all
    assert 'http-equiv="refresh"' in html  # a queued job: the page refreshes itself
    assert browser.get(f"/jobs/{mine}").status_code == 200
    timeline = browser.get(f"/jobs/{mine}/timeline")
    assert timeline.status_code == 200 and "<polyline" in timeline.get_data(as_text=True)
    for path in (f"/jobs/{theirs}", f"/jobs/{theirs}/timeline", "/jobs/not-an-id"):
        page = browser.get(path)
        # A page for the browser, not the JSON API's envelope, and nothing of the other job.
        assert page.status_code == 404, path
        assert page.mimetype == "text/html", path
        assert "No such job" in page.get_data(as_text=True), path
        assert page.headers["Content-Security-Policy"] and page.headers["Cache-Control"]
    long = browser.get("/jobs/" + "x" * 5000).get_data(as_text=True)
    assert "x" * 64 + "..." in long and "x" * 65 not in long


def test_a_wrong_key_gets_no_cookie_and_no_page(app: Flask, db: sa.Engine) -> None:
    browser = app.test_client()
    response = browser.post("/login", data={"key": "tb-not-a-key"})
    assert response.status_code == 400 and "Set-Cookie" not in response.headers
    assert "not valid" in response.get_data(as_text=True)
    page = browser.get("/")
    assert page.status_code == 303 and page.headers["Location"].endswith("/login")


def test_the_cookie_does_not_open_the_json_api(app: Flask, db: sa.Engine) -> None:
    # A cross-site form could ride a cookie; the JSON API only takes the bearer header.
    browser = _signed_in(app, make_key(db, TENANT))
    assert browser.get("/v1/jobs").status_code == 401
    assert browser.post("/v1/jobs", json={"items": [{"prompt": "x"}]}).status_code == 401


def test_metrics_count_requests_jobs_and_items(client: FlaskClient, anonymous: FlaskClient) -> None:
    def sample(text: str, name: str) -> float:
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                if name + " " in line or all(part in line for part in ()):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    before = anonymous.get("/metrics").get_data(as_text=True)
    created = client.post("/v1/jobs", json={"items": [{"prompt": "a"}, {"prompt": "b"}]})
    assert created.status_code == 201
    response = anonymous.get("/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    after = response.get_data(as_text=True)
    for name, delta in (
        ("thinkbatch_api_jobs_submitted_total", 1),
        ("thinkbatch_api_items_submitted_total", 2),
    ):
        assert sample(after, name) - sample(before, name) == delta, name
    assert 'thinkbatch_api_requests_total{method="POST",route="/v1/jobs",status="201"}' in after


def test_progress_reaches_flower_in_the_result_field() -> None:
    sent: list[tuple[str, dict[str, str]]] = []
    now = [0.0]
    reporter = ProgressReporter("j1", lambda e, **f: sent.append((e, f)), clock=lambda: now[0])
    for t, done in ((0.0, 0), (0.5, 1), (2.0, 4), (3.0, 4), (8.0, 4), (9.5, 10)):
        now[0] = t
        reporter(done, 10)
    shown = [eval(f["result"]) for _, f in sent]  # noqa: S307 - our own repr of a dict
    assert [s["done"] for s in shown] == [0, 4, 4, 10]  # a change within 1 s, a resend by 5 s
    assert shown[-1] == {
        "job_id": "j1", "done": 10, "total": 10, "progress": "10/10", "items_per_s": 1.05
    }  # fmt: skip
    assert all(e == "task-progress" for e, _ in sent)
    assert reporter.final({"pending": 0})["progress"] == "10/10"


def test_log_lines_are_json_with_the_bound_ids(settings: Settings) -> None:
    stream = io.StringIO()
    handler = logging_setup.configure(settings, "worker", stream=stream)
    try:
        with logging_setup.bind(job_id="j-1", item_id=7):
            logging.getLogger("thinkbatch.test").warning("stored %d", 3)
    finally:
        logging.getLogger().removeHandler(handler)
    line = json.loads(stream.getvalue().splitlines()[-1])
    assert line["message"] == "stored 3" and line["level"] == "WARNING"
    assert line["job_id"] == "j-1" and line["item_id"] == "7" and line["component"] == "worker"


def test_the_forms_post_only_from_this_sites_pages(app: Flask, db: sa.Engine) -> None:
    """Login CSRF: another site's page must not sign a visitor in to the attacker's tenant."""
    key = make_key(db, TENANT)
    browser = app.test_client()
    for header in ({"Origin": "https://evil.example"}, {"Referer": "https://evil.example/x"}):
        refused = browser.post("/login", data={"key": key}, headers=header)
        assert refused.status_code == 403, header
        assert "Set-Cookie" not in refused.headers
        assert browser.post("/logout", headers=header).status_code == 403
    same = browser.post("/login", data={"key": key}, headers={"Origin": "http://localhost"})
    assert same.status_code == 303 and "Set-Cookie" in same.headers
