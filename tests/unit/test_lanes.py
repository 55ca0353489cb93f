"""Which pool of threads serves a request (api/lanes.py): downloads, batch creates and large
bodies go to the bulk lane, everything else to the quick one; and on a middleware with one
thread in each, a bulk request that holds its thread does not hold a quick one back."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from api.bridge import BatchedWSGIMiddleware
from api.lanes import BULK_BODY_BYTES
from api.lanes import is_bulk
from tests.unit.test_bridge import SCOPE
from tests.unit.test_bridge import _receive


def _scope(method: str, path: str, body: int | None = None) -> dict[str, Any]:
    headers = [(b"host", b"test")]
    if body is not None:
        headers.append((b"content-length", str(body).encode()))
    return {**SCOPE, "method": method, "path": path, "headers": headers}


@pytest.mark.parametrize(
    ("method", "path", "body", "bulk"),
    [
        ("GET", "/v1/jobs/0b4e/results", None, True),
        ("GET", "/v1/files/file-1/content", None, True),
        ("HEAD", "/v1/jobs/0b4e/results", None, True),
        ("POST", "/v1/batches", 120, True),
        ("POST", "/v1/jobs", BULK_BODY_BYTES + 1, True),
        ("POST", "/v1/files", 50 * 1024 * 1024, True),
        ("GET", "/v1/jobs/0b4e", None, False),
        ("GET", "/v1/jobs/0b4e/items", None, False),
        ("GET", "/v1/jobs", None, False),
        ("GET", "/v1/batches", None, False),
        ("GET", "/v1/batches/batch_1", None, False),
        ("GET", "/healthz", None, False),
        ("GET", "/jobs/0b4e/timeline", None, True),
        ("GET", "/jobs/0b4e", None, False),
        ("POST", "/v1/jobs", BULK_BODY_BYTES, False),
        ("POST", "/v1/jobs/0b4e/cancel", 0, False),
        ("POST", "/v1/batches/batch_1/cancel", 0, False),
        ("POST", "/v1/jobs", None, False),
        ("DELETE", "/v1/files/file-1", None, False),
    ],
)
def test_each_request_goes_to_its_lane(
    method: str, path: str, body: int | None, bulk: bool
) -> None:
    assert is_bulk(_scope(method, path, body)) is bulk


def test_a_bulk_request_holding_its_thread_does_not_hold_a_quick_one_back() -> None:
    release = threading.Event()
    served: list[str] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if environ["PATH_INFO"].endswith("/results"):
            assert release.wait(10)
        start_response("200 OK", [])
        served.append(environ["PATH_INFO"])
        return [b"ok"]

    async def send(message: dict[str, Any]) -> None:
        return None

    async def run(middleware: BatchedWSGIMiddleware) -> None:
        bulk = asyncio.ensure_future(
            middleware(_scope("GET", "/v1/jobs/j/results"), _receive, send)  # type: ignore[arg-type]
        )
        await asyncio.sleep(0.1)  # the bulk request holds the bulk lane's one thread
        await asyncio.wait_for(
            middleware(_scope("GET", "/v1/jobs/j"), _receive, send),  # type: ignore[arg-type]
            5,
        )
        assert served == ["/v1/jobs/j"]  # served while the bulk one still waits
        release.set()
        await asyncio.wait_for(bulk, 5)

    middleware = BatchedWSGIMiddleware(app, workers=1, bulk_workers=1)
    try:
        asyncio.run(run(middleware))
    finally:
        release.set()
        middleware.executor.shutdown()
        middleware.bulk_executor.shutdown()
    assert served == ["/v1/jobs/j", "/v1/jobs/j/results"]
