"""The WSGI bridge (api/bridge.py): a response goes back in order and whole; a small one in one
piece, with no sender task; a long one in batches, the app's thread running ahead of a slow
client into the response's spool and never waiting for it while the process's spools have
room, and never more than a bounded amount in memory; with no room, never far ahead of the
client; a client that goes away stops the app's iterator (its `close()` runs), frees the app's
thread and gives back its spool; an app's error reaches the server."""

from __future__ import annotations

import asyncio
import os
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
from api.bridge import SpoolBudget

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


def _serve(
    app: Any, send: Any, executor: ThreadPoolExecutor, budget: SpoolBudget | None = None
) -> Responder:
    """One request through a Responder on a fresh loop; the responder, for its state. Within
    a deadline: a request that never ends fails the test instead of hanging it."""

    async def run() -> Responder:
        responder = Responder(app, executor, 10, budget)
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


def _numbered(chunks: int, chunk: int, made: list[int] | None = None) -> Any:
    """An app whose body is `chunks` pieces of `chunk` bytes, each ending in its number;
    `made` counts the bytes it has produced."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        start_response("200 OK", [("Content-Type", "application/x-ndjson")])
        for k in range(chunks):
            if made is not None:
                made[0] += chunk
            yield b"x" * (chunk - 8) + b"%08d" % k

    return app


def _in_order(data: bytes, chunks: int, chunk: int) -> bool:
    numbers = [int(data[k * chunk - 8 : k * chunk]) for k in range(1, chunks + 1)]
    return len(data) == chunks * chunk and numbers == list(range(chunks))


def test_a_long_response_to_a_stalled_client_is_made_in_full_into_its_spool() -> None:
    """The client takes nothing until the app has made all of its 6.5 MB: the app's thread
    never waited for it, at most UNSENT_BYTES_MAX and a batch of it stayed in memory, the rest
    went to the spool; then the client gets every byte in order, and the spool and its room
    are given back."""
    chunks, chunk = 400, 16_384
    made = [0]
    app_done = threading.Event()
    body: list[bytes] = []
    most_unsent = [0]
    budget = SpoolBudget(64 * 1024 * 1024)

    def app(environ: dict[str, Any], start_response: Any) -> Iterator[bytes]:
        yield from _numbered(chunks, chunk, made)(environ, start_response)
        app_done.set()

    async def run(executor: ThreadPoolExecutor) -> Responder:
        responder = Responder(app, executor, 10, budget)
        client_reads = asyncio.Event()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                most_unsent[0] = max(most_unsent[0], responder.unsent)
                await client_reads.wait()
                body.append(message["body"])

        task = asyncio.ensure_future(responder(SCOPE, _receive, send))  # type: ignore[arg-type]
        for _ in range(500):
            if app_done.is_set():
                break
            await asyncio.sleep(0.01)
        assert app_done.is_set(), "the app's thread waited for a client that took nothing"
        assert body == []
        assert responder.spooled > 0 and budget.held == responder.spooled
        client_reads.set()
        await asyncio.wait_for(task, 30)
        return responder

    with ThreadPoolExecutor(1) as executor:
        responder = asyncio.run(run(executor))
    assert _in_order(b"".join(body), chunks, chunk)
    assert most_unsent[0] <= UNSENT_BYTES_MAX + FLUSH_BYTES  # memory: bounded, the rest spooled
    assert responder.spool is None and responder.spooled == 0 and budget.held == 0


def test_past_the_spool_budget_a_response_waits_for_its_client() -> None:
    """The process's spools may hold 2 MiB: a 6.5 MB response to a slow client runs at most
    that, what is in memory and a batch ahead of it, and still arrives whole."""
    chunks, chunk = 400, 16_384
    made = [0]
    delivered = [0]
    ahead: list[int] = []
    body: list[bytes] = []
    budget = SpoolBudget(2 * 1024 * 1024)

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            ahead.append(made[0] - delivered[0])
            await asyncio.sleep(0.0005)  # a client reading slowly
            body.append(message["body"])
            delivered[0] += len(message["body"])

    with ThreadPoolExecutor(1) as executor:
        responder = _serve(_numbered(chunks, chunk, made), send, executor, budget)
    assert _in_order(b"".join(body), chunks, chunk)
    assert max(ahead) <= UNSENT_BYTES_MAX + budget.limit + 3 * FLUSH_BYTES
    assert max(ahead) > UNSENT_BYTES_MAX + FLUSH_BYTES  # the spool was used
    assert responder.spooled == 0 and budget.held == 0


@pytest.mark.parametrize("disk", ["full", "short", "fills_up", "slow_to_take"])
def test_a_spool_write_that_fails_or_falls_short_never_costs_a_byte(
    monkeypatch: pytest.MonkeyPatch, disk: str
) -> None:
    """A full temporary directory refuses the write (`full`), writes part of it and then no
    more (`short`), or writes some batches and then fills up (`fills_up`): the response is
    neither cut short nor padded, it waits for its client. A write that takes part of a
    batch at a time (`slow_to_take`) is finished. The client gets every byte in order."""
    chunks, chunk = 200, 16_384
    real = os.pwrite
    calls = [0]

    def pwrite(fd: int, data: Any, offset: int) -> int:
        calls[0] += 1
        if disk == "full" or (disk == "fills_up" and calls[0] > 3):
            raise OSError(28, "No space left on device")
        if disk == "short" or disk == "slow_to_take":
            if disk == "short" and calls[0] > 1:
                return 0
            return real(fd, bytes(data[: max(1, len(data) // 3)]), offset)
        return real(fd, data, offset)

    monkeypatch.setattr("api.bridge.os.pwrite", pwrite)
    body: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            await asyncio.sleep(0.0005)
            body.append(message["body"])

    budget = SpoolBudget(64 * 1024 * 1024)
    with ThreadPoolExecutor(1) as executor:
        responder = _serve(_numbered(chunks, chunk), send, executor, budget)
    assert _in_order(b"".join(body), chunks, chunk)
    assert responder.spool_failed is (disk != "slow_to_take")
    if disk in ("fills_up", "slow_to_take"):
        assert responder.spool_end > 0  # the spool served this response until it filled up
    assert budget.held == 0


def test_a_long_response_is_never_far_ahead_of_a_slow_client() -> None:
    """With no spool room at all (RESPONSE_SPOOL_MAX_BYTES 0), as ever: the app's thread
    waits for the client once UNSENT_BYTES_MAX of its response is unsent."""
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

    budget = SpoolBudget(4 * 1024 * 1024)  # the stuck client's spool fills, then the app waits

    async def run(executor: ThreadPoolExecutor) -> bool:
        app = _endless(closed, yielded, start_s=0.6 if writes == "late" else 0)
        responder = Responder(app, executor, 10, budget)
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
    assert budget.held == 0  # its spool, if it had one, was given back


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
