"""A job's thinking statistics (`stats` on GET /v1/jobs/{id}) and `include_thinking`."""

from __future__ import annotations

import json
import uuid

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

from tests.helpers import seed_job
from thinkbatch import ledger
from thinkbatch.settings import Settings

# (thinking, answer, finish_reason, truncated, completion_tokens, reasoning_tokens)
RESULTS = [
    ("t", "a", "stop", False, 30, 10),  # thought on its own
    ("t", "a", "stop", False, 50, 20),
    ("t", "a", "stop", True, 40, 17),  # closed by a budget of 16, then answered
    ("t", "", "length", True, 64, 64),  # cut by max_tokens inside the thinking
    ("", "a", "stop", False, 12, 0),  # thinking off
]


def _complete(db: sa.Engine, job_id: uuid.UUID, results: list[tuple]) -> None:  # type: ignore[type-arg]
    with db.begin() as conn:
        conn.execute(
            sa.text("INSERT INTO workers (id, hostname, pid, model) VALUES ('w', 'h', 1, 'm')")
        )
        claimed = ledger.claim(conn, job_id, owner="w", n=len(results), lease_s=60)
        done = [
            ledger.Done(c.id, job_id, c.attempt, t, a, f, tr, 5, comp, reas)
            for c, (t, a, f, tr, comp, reas) in zip(claimed, results, strict=True)
        ]
        ledger.complete(conn, "w", done)


@pytest.fixture
def finished(client: FlaskClient, db: sa.Engine, settings: Settings) -> uuid.UUID:
    job_id = seed_job(db, settings, n=len(RESULTS))
    _complete(db, job_id, RESULTS)
    return job_id


def test_the_job_reports_what_thinking_cost(client: FlaskClient, finished: uuid.UUID) -> None:
    job = client.get(f"/v1/jobs/{finished}").json
    assert job["usage"]["reasoning_tokens"] == 111
    assert job["stats"] == {
        "reasoning_share": pytest.approx(111 / 196),
        "thinking_tokens": {"items": 4, "p50": 17, "p90": 64, "max": 64},
        "thinking_truncated": {"by_budget": 1, "by_max_tokens": 1},
    }


def test_a_finished_job_never_shows_figures_cached_while_it_ran(
    client: FlaskClient, db: sa.Engine, settings: Settings
) -> None:
    job_id = seed_job(db, settings, n=len(RESULTS))
    _complete(db, job_id, RESULTS[:1])
    running = client.get(f"/v1/jobs/{job_id}").json
    assert running["status"] == "running" and running["stats"]["thinking_tokens"]["items"] == 1
    with db.begin() as conn:
        claimed = ledger.claim(conn, job_id, owner="w", n=len(RESULTS) - 1, lease_s=60)
        ledger.complete(
            conn,
            "w",
            [
                ledger.Done(c.id, job_id, c.attempt, t, a, f, tr, 5, comp, reas)
                for c, (t, a, f, tr, comp, reas) in zip(claimed, RESULTS[1:], strict=True)
            ],
        )
        ledger.finalize_jobs(conn, [job_id])
    done = client.get(f"/v1/jobs/{job_id}").json  # within the running job's cache time
    assert done["status"] == "completed"
    assert done["stats"]["thinking_tokens"]["items"] == 4, done["stats"]


def test_a_job_without_results_has_empty_stats(
    client: FlaskClient, db: sa.Engine, settings: Settings
) -> None:
    job_id = seed_job(db, settings, n=2)
    assert client.get(f"/v1/jobs/{job_id}").json["stats"] == {
        "reasoning_share": None,
        "thinking_tokens": {"items": 0, "p50": None, "p90": None, "max": None},
        "thinking_truncated": {"by_budget": 0, "by_max_tokens": 0},
    }


def test_lists_leave_stats_out(client: FlaskClient, finished: uuid.UUID) -> None:
    assert client.get("/v1/jobs").json["data"][0]["stats"] is None


def test_submit_and_cancel_return_the_stats_too(client: FlaskClient, db: sa.Engine) -> None:
    job = client.post("/v1/jobs", json={"items": [{"prompt": "x"}]}).json
    assert job["stats"]["thinking_tokens"]["items"] == 0
    assert client.get(f"/v1/jobs/{job['id']}").json == job
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel").json
    assert cancelled["stats"] == job["stats"]


@pytest.mark.parametrize("path", ["items", "results"])
def test_results_without_thinking(client: FlaskClient, finished: uuid.UUID, path: str) -> None:
    def records(query: str) -> list[dict[str, object]]:
        response = client.get(f"/v1/jobs/{finished}/{path}{query}")
        assert response.status_code == 200, response.json
        if path == "items":
            return response.json["data"]
        return [json.loads(line) for line in response.data.splitlines()]

    full, lean = records("?include_thinking=true"), records("?include_thinking=false")
    assert [r["thinking"] for r in full] == [r[0] for r in RESULTS]
    assert all(r["thinking"] is None for r in lean)
    assert [r["answer"] for r in lean] == [r["answer"] for r in full]
    assert records("") == full


@pytest.mark.parametrize("value", ["False", "0", "no", "", "true&include_thinking=false"])
@pytest.mark.parametrize("path", ["items", "results"])
def test_include_thinking_is_strict(
    client: FlaskClient, finished: uuid.UUID, path: str, value: str
) -> None:
    response = client.get(f"/v1/jobs/{finished}/{path}?include_thinking={value}")
    response.get_data()  # a stream read to its end releases its database cursor
    assert response.status_code == 400
    assert response.json["error"]["param"] == "include_thinking"
