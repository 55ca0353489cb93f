"""The WSGI app on the event loop's server: a2wsgi, with its responses handed over in batches.

a2wsgi (a small, maintained WSGI-to-ASGI bridge) runs the Flask app on a pool of threads and
builds its environ and input; what it does with a response costs more than the app's own work
on a small request. Each message of a response (its start, each body chunk, its end) is a
round trip: the app's thread schedules a put on the event loop and blocks until the loop has
run it, three round trips for a status call on top of the hop into the pool. On a 2-core
x86_64 CPU host, `python -m bench.http_stack` measured the API's CPU per request with this
responder at 0.62 of a2wsgi's own for /healthz and 0.77 for a status call (its latest output
is in docs/performance.md).

`Responder` keeps a2wsgi's environ, input and thread pool, and changes only how a response
travels back. The app's thread collects the messages; a response that ends within FLUSH_BYTES
(every JSON answer) goes back in one piece when the thread returns, with no round trip at all.
A longer one (a results download) is flushed in batches of FLUSH_BYTES to a sender task on the
loop, without waiting for them to be written, so the thread goes on producing while the loop
writes; it waits only when more than UNSENT_BYTES_MAX are still unwritten, so a client that
reads slowly holds back its own download and never fills the process's memory.

A client that goes away mid-download ends the request one of two ways: a write to it fails, or
(gunicorn over HTTP/1, whose writes to a closed connection do nothing) the server cancels the
request after its disconnect grace period. Either way the app's iterator is stopped at its
next batch, also while it waits for room: its `close()` runs (a download's database connection
is given back) and its thread is free for the next request.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from typing import cast

from a2wsgi.asgi_typing import HTTPScope
from a2wsgi.asgi_typing import Receive
from a2wsgi.asgi_typing import Scope
from a2wsgi.asgi_typing import Send
from a2wsgi.asgi_typing import SendEvent
from a2wsgi.wsgi import Body
from a2wsgi.wsgi import WSGIMiddleware
from a2wsgi.wsgi import WSGIResponder
from a2wsgi.wsgi import build_environ
from a2wsgi.wsgi_typing import WSGIApp

# A response's messages go to the loop in batches of about this many body bytes.
FLUSH_BYTES = 64 * 1024
# The app's thread waits while this many bytes it produced are not yet written to the client.
UNSENT_BYTES_MAX = 1024 * 1024


class ClientGone(OSError):
    """Raised in the app's thread when the client went away during its response."""


class Responder(WSGIResponder):
    """One request: the app runs on the pool, its response comes back in batches."""

    def __init__(self, app: WSGIApp, executor: ThreadPoolExecutor, send_queue_size: int) -> None:
        super().__init__(app, executor, send_queue_size)
        self.batches: asyncio.Queue[list[SendEvent] | None] = asyncio.Queue()
        self.pending: list[SendEvent] = []
        self.pending_bytes = 0
        self.unsent = 0
        self.room = threading.Condition()
        # Why the app's thread must stop: what the sender met writing to the client, or the
        # request's end (cancelled by the server) while the thread still runs.
        self.failed: BaseException | None = None
        self.ended = False  # the request is over: batches the thread still hands over go nowhere
        self.sender_task: asyncio.Task[None] | None = None
        self.client_send: Send | None = None

    async def __call__(self, scope: HTTPScope, receive: Receive, send: Send) -> None:
        self.client_send = send
        environ = build_environ(scope, Body(self.loop, receive))
        context = contextvars.copy_context()
        try:
            try:
                await self.loop.run_in_executor(
                    self.executor, context.run, self.wsgi, environ, self.start_response
                )
            except ClientGone:
                pass  # the sender's own error is raised below
            if self.sender_task is None:  # the whole response was one batch
                for message in self.pending:
                    await send(message)
            else:
                if self.failed is None:
                    self.batches.put_nowait(self.pending)
                self.batches.put_nowait(None)
                await self.sender_task
            if self.exc_info is not None:
                raise self.exc_info[0].with_traceback(self.exc_info[1], self.exc_info[2])
        finally:
            # However the request ends (a client gone, the server's cancel, an error), a thread
            # still producing stops at its next batch, also one waiting for room, and nothing
            # it hands over later starts a sender.
            with self.room:
                self.ended = True
                if self.failed is None:
                    self.failed = ClientGone("the request ended before its response")
                self.room.notify_all()
            if self.sender_task is not None and not self.sender_task.done():
                self.sender_task.cancel()

    def send(self, message: SendEvent | None) -> None:
        """In the app's thread: keep the message; hand a full batch to the loop."""
        assert message is not None  # a2wsgi sends None only from the loop, to end the sender
        self.pending.append(message)
        self.pending_bytes += _body_size(message)
        if self.pending_bytes < FLUSH_BYTES or not cast(dict[str, Any], message).get("more_body"):
            return  # the end of the response goes back with the thread's return
        batch, size = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        with self.room:
            while self.unsent > UNSENT_BYTES_MAX and self.failed is None:
                self.room.wait()
            if self.failed is not None:
                raise ClientGone("the client went away during the response")
            self.unsent += size
        self.loop.call_soon_threadsafe(self._deliver, batch)

    def _deliver(self, batch: list[SendEvent]) -> None:
        """On the loop: queue a batch, starting the sender on the first."""
        if self.ended:
            return
        self.batches.put_nowait(batch)
        if self.sender_task is None:
            assert self.client_send is not None
            self.sender_task = self.loop.create_task(self.sender(self.client_send))

    async def sender(self, send: Send) -> None:
        try:
            while (batch := await self.batches.get()) is not None:
                for message in batch:
                    await send(message)
                with self.room:
                    self.unsent -= sum(_body_size(m) for m in batch)
                    self.room.notify_all()
        except BaseException as error:
            with self.room:
                self.failed = error
                self.room.notify_all()
            raise


def _body_size(message: SendEvent) -> int:
    return len(cast(dict[str, Any], message).get("body", b""))


class BatchedWSGIMiddleware(WSGIMiddleware):
    """a2wsgi's middleware with `Responder` for HTTP requests."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await Responder(self.app, self.executor, self.send_queue_size)(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
