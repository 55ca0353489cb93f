"""The HTTP layer: media types (415), query parameters (400 naming the parameter), routing
errors in the error envelope (404, 405 with Allow), and slow uploads that must not starve others."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from flask.testing import FlaskClient

GOOD = {"items": [{"custom_id": "a", "prompt": "hi"}]}
NO_JOB = "00000000-0000-0000-0000-000000000000"


def stored_jobs(db: sa.Engine) -> int:
    with db.connect() as conn:
        return conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one()


def assert_envelope(response: Any, status: int, param: str | None) -> dict[str, Any]:
    assert response.status_code == status, response.data[:500]
    assert response.mimetype == "application/json"
    error = response.json["error"]
    assert set(error) == {"type", "code", "message", "param"}
    assert error["param"] == param
    return error


# --- Content-Type ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        None,
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/json; charset=latin-1",
        "application/jsonx",
        "application/vnd.api+json",
        "text/json",
    ],
)
def test_a_body_that_is_not_declared_json_is_415(
    client: FlaskClient, db: sa.Engine, content_type: str | None
) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    response = client.post("/v1/jobs", data=json.dumps(GOOD), headers=headers)
    error = assert_envelope(response, 415, None)
    assert "application/json" in error["message"]
    assert stored_jobs(db) == 0


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_json_with_or_without_utf8_charset_is_accepted(
    client: FlaskClient, db: sa.Engine, content_type: str
) -> None:
    response = client.post("/v1/jobs", data=json.dumps(GOOD), content_type=content_type)
    assert response.status_code == 201, response.json


def test_cancel_takes_no_body_but_refuses_a_form(client: FlaskClient, db: sa.Engine) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    form = client.post(f"/v1/jobs/{job_id}/cancel", data={"a": "b"})
    assert_envelope(form, 415, None)
    plain = client.post(f"/v1/jobs/{job_id}/cancel", data="x", content_type="text/plain")
    assert_envelope(plain, 415, None)
    assert client.get(f"/v1/jobs/{job_id}").json["status"] == "queued"  # nothing happened
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 200


# --- query parameters -----------------------------------------------------------------------

BAD_LIMITS = ["0", "1001", "x", "1_0", " 1", "1 ", "２", "+2", "-1", "1e2", "1.0", "", "0x10",
              "99999999999999999999999", "١٠"]  # fmt: skip


@pytest.mark.parametrize("value", BAD_LIMITS)
@pytest.mark.parametrize("route", ["jobs", "items"])
def test_limit_takes_plain_ascii_digits_only(
    client: FlaskClient, db: sa.Engine, route: str, value: str
) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    path = "/v1/jobs" if route == "jobs" else f"/v1/jobs/{job_id}/items"
    response = client.get(path, query_string={"limit": value})
    assert_envelope(response, 400, "limit")


def test_good_limits(client: FlaskClient, db: sa.Engine) -> None:
    client.post("/v1/jobs", json=GOOD)
    assert len(client.get("/v1/jobs?limit=1").json["data"]) == 1
    assert client.get("/v1/jobs?limit=1000").status_code == 200
    assert client.get("/v1/jobs?limit=007").status_code == 200


@pytest.mark.parametrize(
    "spell",
    [
        lambda _: "garbage",
        lambda _: "a\x00",
        lambda i: i.replace("-", ""),
        lambda i: "{" + i + "}",
        lambda i: "urn:uuid:" + i,
        lambda i: i.replace("-", "_", 1),
        lambda i: i.translate(str.maketrans("0123456789", "０１２３４５６７８９")),
    ],
    ids=["garbage", "nul", "no hyphens", "braces", "urn", "underscore", "fullwidth digits"],
)
def test_job_list_cursor_must_be_a_job_id(client: FlaskClient, db: sa.Engine, spell: Any) -> None:
    # Only the canonical spelling of an id that exists: no other spelling maps to a job.
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    if not any(c.isdigit() for c in job_id):
        job_id = job_id.replace(job_id[0], "1", 1)
    response = client.get("/v1/jobs", query_string={"after": spell(job_id)})
    assert_envelope(response, 400, "after")


def test_job_list_cursor_of_no_job_is_400(client: FlaskClient, db: sa.Engine) -> None:
    assert_envelope(client.get(f"/v1/jobs?after={NO_JOB}"), 400, "after")


@pytest.mark.parametrize("value", ["nope", "a\x00", "a%00"])
def test_items_cursor_errors_name_after(client: FlaskClient, db: sa.Engine, value: str) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    response = client.get(f"/v1/jobs/{job_id}/items", query_string={"after": value})
    assert_envelope(response, 400, "after")


def test_items_cursor_with_a_percent_encoded_nul(client: FlaskClient, db: sa.Engine) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    assert_envelope(client.get(f"/v1/jobs/{job_id}/items?after=a%00"), 400, "after")


@pytest.mark.parametrize("value", ["done", "PENDING", "pending\x00", " pending"])
@pytest.mark.parametrize("route", ["items", "results"])
def test_bad_status_filter(client: FlaskClient, db: sa.Engine, route: str, value: str) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    response = client.get(f"/v1/jobs/{job_id}/{route}", query_string={"status": value})
    assert_envelope(response, 400, "status")


@pytest.mark.parametrize("name", ["limit", "after", "status"])
def test_a_parameter_given_twice_is_400(client: FlaskClient, db: sa.Engine, name: str) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    one, two = {"limit": ("1", "2"), "after": ("a", "b"), "status": ("pending", "failed")}[name]
    assert client.get(f"/v1/jobs/{job_id}/items?{name}={one}").status_code == 200
    response = client.get(f"/v1/jobs/{job_id}/items?{name}={one}&{name}={two}")
    assert_envelope(response, 400, name)


# Routes that take no `limit`, `after` or `offset`, and lists that take no `offset` (a common
# guess for `after`): each is refused by name, never ignored with a 200.
@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/v1/jobs/{job}/results", "limit"),
        ("/v1/jobs/{job}/results", "after"),
        ("/v1/jobs/{job}", "include_thinking"),
        ("/v1/jobs", "offset"),
        ("/v1/jobs", "status"),
        ("/v1/jobs/{job}/items", "page"),
        ("/v1/files", "offset"),
        ("/v1/batches", "order"),
        ("/healthz", "verbose"),
    ],
)
def test_a_query_parameter_the_route_does_not_take_is_400(
    client: FlaskClient, db: sa.Engine, path: str, name: str
) -> None:
    job_id = client.post("/v1/jobs", json=GOOD).json["id"]
    url = path.format(job=job_id)
    assert client.get(url).status_code == 200
    error = assert_envelope(client.get(url, query_string={name: "5"}), 400, name)
    assert error["code"] == "unknown_parameter"
    assert "unknown query parameter" in error["message"]


def test_an_unknown_parameter_from_a_stranger_is_still_401(anonymous: FlaskClient) -> None:
    assert anonymous.get("/v1/jobs?offset=5").status_code == 401


def test_a_long_unknown_parameter_name_is_cut_in_the_error(
    client: FlaskClient, db: sa.Engine
) -> None:
    error = assert_envelope(client.get("/v1/jobs", query_string={"x" * 5000: "1"}), 400, "x" * 64)
    assert len(error["message"]) < 300


def test_a_404_echoes_at_most_64_characters_of_the_id(client: FlaskClient, db: sa.Engine) -> None:
    response = client.get("/v1/jobs/" + "z" * 3000)
    error = assert_envelope(response, 404, None)
    assert error["message"] == f"no job {'z' * 64 + '...'!r}"


# --- routing errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("DELETE", "/v1/jobs", {"GET", "POST"}),
        ("PUT", "/v1/jobs", {"GET", "POST"}),
        ("POST", f"/v1/jobs/{NO_JOB}", {"GET"}),
        ("GET", f"/v1/jobs/{NO_JOB}/cancel", {"POST"}),
        ("POST", "/healthz", {"GET"}),
    ],
)
def test_405_names_the_allowed_methods(
    client: FlaskClient, db: sa.Engine, method: str, path: str, allowed: set[str]
) -> None:
    response = client.open(path, method=method)
    assert_envelope(response, 405, None)
    assert {m.strip() for m in response.headers["Allow"].split(",")} - {"HEAD", "OPTIONS"} == (
        allowed
    )


@pytest.mark.parametrize("path", ["/nope", "/v1/job", "/v1/jobs/x/y/z", "/v2/jobs"])
def test_an_unknown_route_is_404_in_the_envelope(
    client: FlaskClient, db: sa.Engine, path: str
) -> None:
    error = assert_envelope(client.get(path), 404, None)
    assert error["type"] == "not_found"
