"""The WSGI bridge (api/bridge.py): a response goes back in order and whole; a small one in one
piece, with no sender task; a long one in batches, never more than a bounded amount of it
produced ahead of what the client took; a client that goes away stops the app's iterator (its
`close()` runs) and frees the app's thread; an app's error reaches the server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from api.bridge import FLUSH_BYTES
from api.bridge import UNSENT_BYTES_MAX
from api.bridge import BatchedWSGIMiddleware
from api.bridge import Responder

SCOPE: dict[str, Any] = {
    "type": "http",
    "http_version": "1.1",
    "method": "GET",
    "scheme": "http",
    "path": "/x",
    "raw_path": b"/x",
    "query_string": b"",
    "root_path": "",
    "headers": [(b"host", b"test")],
    "client": ("127.0.0.1", 5000),
    "server": ("127.0.0.1", 8000),
}


async def _receive() -> dict[str, Any]:
    return {"type": "http.request", "body": b"", "more_body": False}


def _serve(app: Any, send: Any, executor: ThreadPoolExecutor) -> Responder:
    """One request through a Responder on a fresh loop; the responder, for its state. Within
    a deadline: a request that never ends fails the test instead of hanging it."""

    async def run() -> Responder:
        responder = Responder(app, executor, 10)
        await asyncio.wait_for(responder(SCOPE, _receive, send), 30)  # type: ignore[arg-type]
        return responder

    return asyncio.run(run())


def _endless(closed: threading.Event, yielded: list[int], start_s: float = 0) -> Any:
    """An app whose download never ends, as one the client stopped reading; its first bytes
    after `start_s` (a slow first query)."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "application/x-ndjson")])
        time.sleep(start_s)
        try:
            while True:
                yielded[0] += 1
                yield b"y" * 32_768
        finally:
            closed.set()  # a download gives its database connection back here

    return app


def _ok(environ: dict[str, Any], start_response: Any) -> list[bytes]:
    start_response("200 OK", [])
    return [b"ok"]


def _served_after(executor: ThreadPoolExecutor) -> bytes:
    """A small request's body: served only if the pool's thread is free."""
    got: list[dict[str, Any]] = []

    async def keep(message: dict[str, Any]) -> None:
        got.append(message)

    _serve(_ok, keep, executor)
    return b"".join(m.get("body", b"") for m in got)


def test_a_small_response_comes_back_whole_in_one_piece() -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("201 Created", [("Content-Type", "application/json"), ("X-A", "1")])
        return [b'{"a":', b"1}"]

    got: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        got.append(message)

    with ThreadPoolExecutor(1) as executor:
        responder = _serve(app, send, executor)
    assert responder.sender_task is None  # no batch left before the app returned
    assert got[0] == {
        "type": "http.response.start",
        "status": 201,
        "headers": [(b"content-type", b"application/json"), (b"x-a", b"1")],
    }
    assert b"".join(m.get("body", b"") for m in got[1:]) == b'{"a":1}'
    assert got[-1] == {"type": "http.response.body", "body": b""}  # the end, last


def test_a_long_response_is_never_far_ahead_of_a_slow_client() -> None:
    chunk = b"x" * 16_384
    chunks = 400  # 6.5 MB: many times what may be unsent
    produced = [0]
    ahead: list[int] = []
    delivered = [0]

    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "application/x-ndjson")])
        for k in range(chunks):
            ahead.append(produced[0] - delivered[0])
            produced[0] += len(chunk)
            yield chunk[:-8] + b"%08d" % k

    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.0005)  # a client reading slowly
            body.append(message["body"])
            delivered[0] += len(message["body"])

    with ThreadPoolExecutor(1) as executor:
        responder = _serve(app, send, executor)
    assert responder.sender_task is not None  # it went in batches while the app produced
    data = b"".join(body)
    assert len(data) == chunks * len(chunk)
    assert [int(data[k * len(chunk) - 8 : k * len(chunk)]) for k in range(1, chunks + 1)] == list(
        range(chunks)
    )  # in order, nothing lost or repeated
    # What the app had produced beyond what the client took: at most the unsent bound, the
    # batch being filled and the one being handed over.
    assert max(ahead) <= UNSENT_BYTES_MAX + 2 * FLUSH_BYTES
    assert max(ahead) > FLUSH_BYTES  # the app did run ahead of the client, in batches


def test_a_client_gone_mid_response_stops_the_app_and_frees_its_thread() -> None:
    closed = threading.Event()
    yielded = [0]
    sent = [0]

    class Gone(OSError):
        pass

    async def send(message: dict[str, Any]) -> None:
        sent[0] += 1
        if sent[0] > 5:
            raise Gone("the client closed the connection")

    with ThreadPoolExecutor(1) as executor:
        with pytest.raises(Gone):  # the server's own error, as it raised it
            _serve(_endless(closed, yielded), send, executor)
        assert closed.wait(5)
        assert yielded[0] < 200  # stopped within a few batches of the error
        assert _served_after(executor) == b"ok"  # the app's only thread is free


@pytest.mark.parametrize("writes", ["silent", "stuck", "late"])
def test_a_request_the_server_cancels_stops_the_app_and_frees_its_thread(writes: str) -> None:
    """gunicorn over HTTP/1 writes nothing to a closed connection and raises nothing: it
    cancels the request after its disconnect grace period. The app stops whether its batches
    were being written (`silent`), the thread waited for room behind a write that never
    returns (`stuck`), or its first batch came only after the cancel (`late`: no sender had
    started, and none may start for a request that is over)."""
    closed = threading.Event()
    yielded = [0]
    never = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if writes == "stuck" and message["type"] == "http.response.body":
            await never.wait()
        await asyncio.sleep(0)

    async def run(executor: ThreadPoolExecutor) -> bool:
        app = _endless(closed, yielded, start_s=0.6 if writes == "late" else 0)
        responder = Responder(app, executor, 10)
        task = asyncio.ensure_future(responder(SCOPE, _receive, send))  # type: ignore[arg-type]
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The loop lives on, as a server's does: the app must stop while it runs.
        for _ in range(100):
            if closed.is_set():
                break
            await asyncio.sleep(0.02)
        return closed.is_set()

    with ThreadPoolExecutor(1) as executor:
        stopped = asyncio.run(run(executor))
        assert stopped, "the app's iterator was not closed while the server ran"
        stopped_at = yielded[0]
        assert _served_after(executor) == b"ok"  # the app's only thread is free
        assert yielded[0] == stopped_at


def test_an_app_error_reaches_the_server() -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        raise RuntimeError("boom")

    async def send(message: dict[str, Any]) -> None:
        raise AssertionError("nothing is sent for an app that raised")

    with ThreadPoolExecutor(1) as executor, pytest.raises(RuntimeError, match="boom"):
        _serve(app, send, executor)


def test_the_middleware_serves_http_through_the_responder() -> None:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [])
        return [environ["PATH_INFO"].encode()]

    got: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        got.append(message)

    middleware = BatchedWSGIMiddleware(app, workers=1)
    asyncio.run(middleware(SCOPE, _receive, send))  # type: ignore[arg-type]
    middleware.executor.shutdown()
    assert b"".join(m.get("body", b"") for m in got) == b"/x"
