"""API behaviours that had no test of their own: a submit's hint, the `after` cursors' 400 and
404 cases on both lists, the completion-window cap, and /readyz when a dependency is down."""

from __future__ import annotations

import json
import socket
import uuid
from typing import Any

import redis
import sqlalchemy as sa
from flask.testing import FlaskClient

from api import create_app
from tests.helpers import close_app
from tests.helpers import make_settings
from thinkbatch.queue import model_queue
from thinkbatch.settings import Settings

GOOD = {"items": [{"custom_id": "a", "prompt": "hi"}, {"custom_id": "b", "prompt": "ho"}]}
NO_JOB = "00000000-0000-0000-0000-000000000000"


def error_of(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.data[:500]
    error: dict[str, Any] = response.json["error"]
    assert set(error) == {"type", "code", "message", "param"}
    return error


# --- a submit publishes a hint ----------------------------------------------------------------


def test_a_submit_publishes_a_hint_and_records_it(
    client: FlaskClient, db: sa.Engine, settings: Settings
) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    # The hint is a Celery message on the queue of the job's model, naming the job...
    queue = model_queue(settings, settings.model_name)
    with redis.Redis.from_url(settings.require_redis_url()) as broker:
        messages = [json.loads(m) for m in broker.lrange(queue, 0, -1)]
    hinted = [m for m in messages if m["headers"]["argsrepr"] == repr([job_id])]
    assert hinted, messages
    # ...and the job says so, so that the sweeper does not publish it again.
    with db.connect() as conn:
        hinted_at = conn.execute(
            sa.text("SELECT hinted_at FROM jobs WHERE id = :id"), {"id": job_id}
        ).scalar()
    assert hinted_at is not None


# --- `after` on the job list and the items page -----------------------------------------------


def test_job_list_after_another_tenants_job_is_400(
    client: FlaskClient, rival: FlaskClient, db: sa.Engine
) -> None:
    theirs = rival.post("/v1/jobs", json=GOOD).json["id"]
    error = error_of(client.get("/v1/jobs", query_string={"after": theirs}), 400)
    assert error["param"] == "after"


def test_job_list_after_of_the_last_job_is_an_empty_page(
    client: FlaskClient, db: sa.Engine
) -> None:
    only = client.post("/v1/jobs", json=GOOD).json["id"]
    page = client.get("/v1/jobs", query_string={"after": only}).json
    assert (page["data"], page["has_more"]) == ([], False)


def test_items_after_an_unknown_custom_id_is_400(client: FlaskClient, db: sa.Engine) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    error = error_of(client.get(f"/v1/jobs/{job_id}/items?after=zzz"), 400)
    assert error["param"] == "after"


def test_items_after_a_custom_id_of_another_job_is_400(client: FlaskClient, db: sa.Engine) -> None:
    first = client.post("/v1/jobs", json=GOOD).json["id"]
    other = client.post("/v1/jobs", json={"items": [{"custom_id": "x", "prompt": "p"}]}).json["id"]
    assert first != other
    error = error_of(client.get(f"/v1/jobs/{first}/items?after=x"), 400)
    assert error["param"] == "after"


def test_items_after_on_an_unknown_or_foreign_job_is_404(
    client: FlaskClient, rival: FlaskClient, db: sa.Engine
) -> None:
    # The job is checked before the cursor: a valid-looking cursor does not turn a missing job
    # into a 400, nor reveal that another tenant's job has an item of that custom_id.
    theirs = rival.post("/v1/jobs", json=GOOD).json["id"]
    for job_id in (NO_JOB, theirs):
        error = error_of(client.get(f"/v1/jobs/{job_id}/items?after=a"), 404)
        assert (error["type"], error["code"]) == ("not_found", "job_not_found"), error


# --- the completion-window cap ----------------------------------------------------------------


def test_completion_window_above_the_cap_is_400_and_at_the_cap_is_taken(
    client: FlaskClient, db: sa.Engine, settings: Settings
) -> None:
    cap = settings.max_completion_window_s
    over = client.post("/v1/jobs", json={**GOOD, "completion_window": cap + 1})
    error = error_of(over, 400)
    assert error["param"] == "completion_window"
    assert str(cap) in error["message"]
    at = client.post("/v1/jobs", json={**GOOD, "completion_window": cap})
    assert at.status_code == 201, at.json
    with db.connect() as conn:
        window = conn.execute(
            sa.text("SELECT expires_at - created_at FROM jobs WHERE id = :id"),
            {"id": uuid.UUID(at.json["id"])},
        ).scalar()
    assert window is not None and abs(window.total_seconds() - cap) < 60


# --- /readyz with a dependency down -----------------------------------------------------------


def _closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _readyz(settings: Settings) -> Any:
    app = create_app(settings)
    try:
        return app.test_client().get("/readyz")
    finally:
        close_app(app)


def test_readyz_is_degraded_when_postgres_is_down(database_url: str, redis_url: str) -> None:
    down = sa.make_url(database_url).set(host="127.0.0.1", port=_closed_port())
    response = _readyz(make_settings(down.render_as_string(hide_password=False), redis_url))
    assert response.status_code == 503
    body = response.json
    assert body["status"] == "degraded"
    assert body["checks"]["redis"] == "ok"
    assert body["checks"]["database"].startswith("error: ")


def test_readyz_is_degraded_when_redis_is_down(database_url: str, redis_url: str) -> None:
    down = f"redis://127.0.0.1:{_closed_port()}/0"
    response = _readyz(make_settings(database_url, down))
    assert response.status_code == 503
    body = response.json
    assert body["status"] == "degraded"
    assert body["checks"]["database"] == "ok"
    assert body["checks"]["redis"].startswith("error: ")


def test_readyz_is_ok_when_both_answer(app: Any) -> None:
    response = app.test_client().get("/readyz")
    assert (response.status_code, response.json["status"]) == (200, "ok")
