"""Request bodies are received in full by the server's event loop, never by a request thread.

The API runs on gunicorn's asyncio (ASGI) worker. This middleware sits in front of the Flask app
(run in a thread pool by a2wsgi) and reads every request body off the network into a spool
(memory up to SPOOL_MEMORY_BYTES, a temporary file beyond) before the request is handed to a
thread. A client that sends its body slowly, or not at all, therefore costs a socket and a
coroutine, not one of the threads that serve everyone else: `/healthz` and a small submit are
answered at once however many uploads trickle in.

Every framing (Content-Length or chunked) gets the same deadline, one that only the bytes a
client has actually sent can extend: the body must make progress at least every
REQUEST_READ_TIMEOUT_S, and at any moment the client may have used at most REQUEST_READ_TIMEOUT_S
plus its received bytes at REQUEST_MIN_BYTES_PER_S. A client that declares 256 MiB, or no length
at all, and then trickles a byte now and then is cut off after about REQUEST_READ_TIMEOUT_S,
not after the hours that its declared (or the largest allowed) size would take at that rate.

Each client address may have MAX_UPLOADS_PER_CLIENT bodies being received by one API process at
once; more are refused (429) before any byte of theirs is read. This bounds the sockets, spool
files and disk that one address can hold.

A refusal is not answered here: it is handed to the Flask app (`scope[REFUSAL]`), which raises it
before anything else runs, so that it is answered in the one error envelope, with a request id,
and counted and logged like any other response (api.body.init_app).
"""

from __future__ import annotations

import asyncio
import collections
import tempfile
from collections.abc import Awaitable
from collections.abc import Callable
from collections.abc import Mapping
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import IO
from typing import Any

from thinkbatch.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The keys this middleware adds to an HTTP scope (a2wsgi passes the scope on to the WSGI app
# as environ["asgi.scope"]).
BODY = "thinkbatch.body"  # the spooled body, rewound, for api.body.spool()
REFUSAL = "thinkbatch.refusal"  # a Refusal the app must answer instead of serving the request
# The spooled body is handed on in pieces of this size to readers that go through the WSGI
# input (werkzeug's form parser).
REPLAY_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Refusal:
    """Why a request was not served, for the app to answer: 408, 413 or 429."""

    status: int
    code: str
    message: str
    retry_after: int | None = None


def declared_length(scope: Mapping[str, Any]) -> tuple[int | None, bool]:
    """(Content-Length, chunked) as the client declared them."""
    length: int | None = None
    chunked = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                length = int(value)
            except ValueError:
                length = None
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return length, chunked


class Intake:
    """The ASGI middleware: spool each request body under the deadline, then call `app`."""

    def __init__(self, app: ASGIApp, settings: Settings):
        self.app = app
        self.settings = settings
        self.open: collections.Counter[str] = collections.Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length, chunked = declared_length(scope)
        if not chunked and not length:
            await self.app(scope, receive, send)  # no body: nothing to wait for
            return
        if length is not None and length > self.settings.max_request_bytes:
            await self._refuse(scope, send, _too_large(self.settings))
            return
        address = (scope.get("client") or ("unknown", 0))[0]
        if self.open[address] >= self.settings.max_uploads_per_client:
            await self._refuse(
                scope,
                send,
                Refusal(
                    429,
                    "too_many_uploads",
                    f"this client address already has {self.open[address]} request bodies "
                    f"being received; at most {self.settings.max_uploads_per_client} at once "
                    "(MAX_UPLOADS_PER_CLIENT)",
                    retry_after=max(1, round(self.settings.request_read_timeout_s)),
                ),
            )
            return
        self.open[address] += 1
        try:
            outcome = await self._receive(receive, length)
        finally:
            self.open[address] -= 1
            if self.open[address] <= 0:
                del self.open[address]
        if outcome is None:
            return  # the client went away: there is nobody to answer
        if isinstance(outcome, Refusal):
            await self._refuse(scope, send, outcome)
            return
        with outcome as body:
            await self.app(_with_body(scope, body), _replay(body), send)

    async def _receive(self, receive: Receive, length: int | None) -> IO[bytes] | Refusal | None:
        """The body in a rewound spool, a Refusal, or None when the client disconnected."""
        settings = self.settings
        loop = asyncio.get_running_loop()
        started = last_bytes = loop.time()
        received = 0
        spool = tempfile.SpooledTemporaryFile(max_size=settings.spool_memory_bytes)  # noqa: SIM115
        try:
            while True:
                now = loop.time()
                # The allowance grows only with what has arrived: see the module's docstring.
                allowed = started + settings.request_read_timeout_s
                allowed += received / settings.request_min_bytes_per_s
                stalled = last_bytes + settings.request_read_timeout_s
                wait = min(allowed, stalled) - now
                if wait <= 0:
                    spool.close()
                    return _too_slow(settings, stalled_out=stalled <= allowed)
                try:
                    message = await asyncio.wait_for(receive(), timeout=wait)
                except TimeoutError:
                    continue  # the loop decides which limit ran out
                if message["type"] == "http.disconnect":
                    spool.close()
                    return None
                chunk = message.get("body", b"")
                if chunk:
                    received += len(chunk)
                    last_bytes = loop.time()
                    if received > settings.max_request_bytes:
                        spool.close()
                        return _too_large(settings)
                    spool.write(chunk)
                if not message.get("more_body", False):
                    break
        except BaseException:
            spool.close()
            raise
        if length is not None and received != length:  # the server framed it; never expected
            spool.close()
            return None
        spool.seek(0)
        return spool

    async def _refuse(self, scope: Scope, send: Send, refusal: Refusal) -> None:
        refused = dict(scope)
        refused[REFUSAL] = refusal
        # The app sees no body; the client's unread bytes end with the connection, which the
        # app's answer closes (api.body: Connection: close).
        refused["headers"] = [
            (k, v) for k, v in scope.get("headers", ()) if k not in _BODY_HEADERS
        ] + [(b"content-length", b"0")]
        await self.app(refused, _no_body, send)


_BODY_HEADERS = (b"content-length", b"transfer-encoding")


def _too_large(settings: Settings) -> Refusal:
    return Refusal(
        413,
        "request_entity_too_large",
        f"request body: larger than the limit of {settings.max_request_bytes} bytes "
        "(MAX_REQUEST_BYTES)",
    )


def _too_slow(settings: Settings, *, stalled_out: bool) -> Refusal:
    if stalled_out:
        return Refusal(
            408,
            "request_timeout",
            f"the request body stalled: no bytes for {settings.request_read_timeout_s:g} "
            "seconds (REQUEST_READ_TIMEOUT_S)",
        )
    return Refusal(
        408,
        "request_timeout",
        "the request body is arriving too slowly: below "
        f"{settings.request_min_bytes_per_s} bytes/s on average after the first "
        f"{settings.request_read_timeout_s:g} seconds (REQUEST_MIN_BYTES_PER_S)",
    )


def _with_body(scope: Scope, body: IO[bytes]) -> Scope:
    """The scope as the app sees it: the body's exact length as Content-Length (a chunked body
    is complete by now), and the spool itself for readers that take it whole."""
    size = body.seek(0, 2)
    body.seek(0)
    served = dict(scope)
    served["headers"] = [(k, v) for k, v in scope.get("headers", ()) if k not in _BODY_HEADERS]
    served["headers"].append((b"content-length", str(size).encode()))
    served[BODY] = body
    return served


def _replay(body: IO[bytes]) -> Receive:
    """`receive` for the app: the spooled body, then (as a server would) nothing more."""
    done = False

    async def receive() -> Message:
        nonlocal done
        if done:
            return {"type": "http.disconnect"}
        chunk = body.read(REPLAY_CHUNK)
        more = len(chunk) == REPLAY_CHUNK
        done = not more
        return {"type": "http.request", "body": chunk, "more_body": more}

    return receive


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}
