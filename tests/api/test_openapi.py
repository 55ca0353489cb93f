"""The OpenAPI document describes the live app: schemathesis generates requests from it (valid
and invalid ones) against the WSGI app over the real database, and every answer must be no
server error and must match the document (status, media type, headers, body schema)."""

from __future__ import annotations

import re
import uuid
from typing import Any

import hypothesis
import pytest
import schemathesis
import sqlalchemy as sa
from flask import Flask
from flask.testing import FlaskClient
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import content_type_conformance
from schemathesis.specs.openapi.checks import response_headers_conformance
from schemathesis.specs.openapi.checks import response_schema_conformance
from schemathesis.specs.openapi.checks import status_code_conformance

from tests.helpers import seed_job
from thinkbatch.settings import Settings

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def test_document_lists_every_route(client: FlaskClient, app: Flask) -> None:
    doc = client.get("/openapi.json").json
    assert doc["openapi"].startswith("3.1")
    routes = {
        (re.sub(r"<(\w+)>", r"{\1}", rule.rule), method.lower())
        for rule in app.url_map.iter_rules()
        # The dashboard's HTML pages are a browser UI, not part of the API's contract.
        if rule.endpoint not in ("static", "openapi.assets")
        and not rule.endpoint.startswith("dashboard.")
        for method in rule.methods or ()
        if method not in ("HEAD", "OPTIONS")
    }
    documented = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert documented == routes
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            codes = set(op["responses"])
            assert {"500", "503"} <= codes, (path, method)
            for code, answer in op["responses"].items():
                if code[0] in "45" and path != "/readyz":  # a probe: 503 says which check
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ApiError"}, (path, code)
    results = doc["paths"]["/v1/jobs/{job_id}/results"]["get"]["responses"]["200"]
    assert list(results["content"]) == ["application/x-ndjson"]
    body = doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/JobCreate"}


def test_every_params_field_is_documented_with_its_bounds(client: FlaskClient) -> None:
    from thinkbatch.jobs.wire import SamplingParamsIn

    schemas = client.get("/openapi.json").json["components"]["schemas"]
    documented = schemas["SamplingParamsIn"]["properties"]
    assert set(documented) == set(SamplingParamsIn.model_fields)
    assert all(field.get("description") for field in documented.values())
    n = next(b for b in documented["n"]["anyOf"] if b.get("type") == "integer")
    assert (n["minimum"], n["maximum"]) == (1, 128)
    for name in ("ResponseFormat", "StructuredOutputs", "Tool", "NamedToolChoice"):
        assert name in schemas


def test_docs_page_is_served_from_this_app(client: FlaskClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200 and page.mimetype == "text/html"
    html = page.get_data(as_text=True)
    assert "http://" not in html and "https://" not in html  # no CDN: works offline
    for asset in ("docs/assets/swagger-ui-bundle.js", "docs/assets/swagger-ui.css"):
        assert asset in html
        response = client.get("/" + asset)
        assert response.status_code == 200 and len(response.data) > 10_000
        response.close()


@pytest.fixture
def seeded(db: sa.Engine, settings: Settings) -> str:
    return str(seed_job(db, settings, n=3))


def _operations() -> list[str]:
    # The operations to fuzz, known without an app: one test each, so a failure names it.
    return ["GET /healthz", "GET /readyz", "POST /v1/jobs", "GET /v1/jobs",
            "GET /v1/jobs/{job_id}", "GET /v1/jobs/{job_id}/items",
            "GET /v1/jobs/{job_id}/results", "POST /v1/jobs/{job_id}/cancel",
            "GET /openapi.json", "GET /docs", "GET /metrics",
            "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}",
            "DELETE /v1/files/{file_id}", "GET /v1/files/{file_id}/content",
            "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
            "POST /v1/batches/{batch_id}/cancel", "GET /v1/models"]  # fmt: skip


def test_fuzzed_operations_are_the_documented_ones(client: FlaskClient) -> None:
    doc = client.get("/openapi.json").json
    documented = {f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops}
    assert documented == set(_operations())


# schemathesis's pytest loader (`schemathesis.pytest.from_fixture`) breaks on pytest 9 (it sets
# `node._nodeid`), so its strategies are driven with hypothesis directly; same generation and
# the same checks as `case.call_and_validate`.
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("name", _operations())
def test_fuzzed_requests_get_documented_answers(
    app: Flask, seeded: str, name: str, mode: GenerationMode
) -> None:
    schema = schemathesis.openapi.from_wsgi("/openapi.json", app)
    method, path = name.split(" ", 1)
    operation = schema[path][method]
    if mode is GenerationMode.NEGATIVE and not (operation.body or any(operation.iter_parameters())):
        pytest.skip("nothing to make invalid: no parameters, no body")

    # max_examples is the profile's: 100 by default, 20 under `make check` (see conftest.py).
    @hypothesis.settings(
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(hypothesis.HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        # Half the well-formed job ids point at a real job, so that pages, results and cancel
        # are exercised beyond their 404.
        job_id = (case.path_parameters or {}).get("job_id")
        if isinstance(job_id, str):
            try:
                if uuid.UUID(job_id).int % 2 == 0:
                    case.path_parameters["job_id"] = seeded
            except ValueError:
                pass
        case.call_and_validate(checks=CHECKS)

    fuzz()
