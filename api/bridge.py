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
writes.

The app's thread never waits for a slow client. Up to UNSENT_BYTES_MAX of a response may wait
in memory for its client; what the thread makes beyond that goes to a temporary file of the
response's own (its spool), which the sender sends on, in order, as the client takes it. A
client that reads slowly, or stops reading, then holds a socket, a coroutine and disk, never
one of the threads that serve everyone else, nor the download's database connection: the
thread is busy only as long as Postgres takes to make the rows. The spools of one process hold
at most RESPONSE_SPOOL_MAX_BYTES (`SpoolBudget`); past it, a thread waits for its client as
with no spool, until other spools drain. A client that takes none of a response's bytes for
RESPONSE_WRITE_TIMEOUT_S is dropped by the kernel (TCP_USER_TIMEOUT on each of the API's TCP
connections, api/server.py), which ends its request and frees its spool.

A client that goes away mid-download ends the request one of two ways: a write to it fails, or
(gunicorn over HTTP/1, whose writes to a closed connection do nothing) the server cancels the
request after its disconnect grace period. Either way the app's iterator is stopped at its
next batch, also while it waits for room: its `close()` runs (a download's database connection
is given back) and its thread is free for the next request.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO
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

from api.lanes import is_bulk

# A response's messages go to the loop in batches of about this many body bytes.
FLUSH_BYTES = 64 * 1024
# At most this many bytes of a response wait in memory for its client; more go to its spool.
UNSENT_BYTES_MAX = 1024 * 1024


class SpoolBudget:
    """The bytes of one process's response spools not yet sent to their clients, held within
    `limit`: a response's thread takes room before it spills a batch, its sender gives the
    room back as the client takes the bytes, and the request's end gives back the rest."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.lock = threading.Lock()

    def try_take(self, size: int) -> bool:
        with self.lock:
            if self.held + size > self.limit:
                return False
            self.held += size
            return True

    def give_back(self, size: int) -> None:
        with self.lock:
            self.held -= size


@dataclass(frozen=True, slots=True)
class _Spooled:
    """A run of a response's body bytes in its spool, in the sender's queue in its place."""

    start: int
    size: int


class ClientGone(OSError):
    """Raised in the app's thread when the client went away during its response."""


class Responder(WSGIResponder):
    """One request: the app runs on the pool, its response comes back in batches."""

    def __init__(
        self,
        app: WSGIApp,
        executor: ThreadPoolExecutor,
        send_queue_size: int,
        budget: SpoolBudget | None = None,
    ) -> None:
        # a2wsgi's own __init__ would make a queue this responder never uses: of what it sets,
        # its start_response and wsgi need these. A queue costs as much as a status call's
        # own routing, so the batches' queue is made only for a response that has batches.
        self.app = app
        self.executor = executor
        self.loop = asyncio.get_running_loop()
        self.response_started = False
        self.exc_info: Any = None
        del send_queue_size  # a2wsgi's, for its queue
        self.batches: asyncio.Queue[list[SendEvent] | _Spooled | None] | None = None
        self.pending: list[SendEvent] = []
        self.pending_bytes = 0
        # Guards what the app's thread and the loop share: the counts, the failure, the spool.
        self.room = threading.Condition()
        self.unsent = 0  # bytes of batches in memory, handed to the loop and not yet sent
        # Why the app's thread must stop: what the sender met writing to the client, or the
        # request's end (cancelled by the server) while the thread still runs.
        self.failed: BaseException | None = None
        self.ended = False  # the request is over: batches the thread still hands over go nowhere
        self.sender_task: asyncio.Task[None] | None = None
        self.client_send: Send | None = None
        self.budget = budget if budget is not None else SpoolBudget(0)
        self.spool: IO[bytes] | None = None  # made at the first batch that does not fit
        self.spool_end = 0  # bytes written to the spool
        self.spooled = 0  # of them, not yet sent: room this response holds in the budget
        self.spool_failed = False
        self.writing = False  # the app's thread is writing to the spool, outside `room`

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
                assert self.batches is not None  # made with the sender
                if self.failed is None:
                    self.batches.put_nowait(self.pending)
                self.batches.put_nowait(None)
                await self.sender_task
            if self.exc_info is not None:
                raise self.exc_info[0].with_traceback(self.exc_info[1], self.exc_info[2])
        finally:
            # However the request ends (a client gone, the server's cancel, an error), a thread
            # still producing stops at its next batch, also one waiting for room, and nothing
            # it hands over later starts a sender. The spool goes with its room, here or, if
            # the thread is writing to it right now, by the thread once its write returns.
            with self.room:
                self.ended = True
                if self.failed is None:
                    self.failed = ClientGone("the request ended before its response")
                self.room.notify_all()
                if not self.writing:
                    self._close_spool()
            if self.sender_task is not None and not self.sender_task.done():
                self.sender_task.cancel()

    def send(self, message: SendEvent | None) -> None:
        """In the app's thread: keep the message; hand a full batch to the loop, in memory
        while little of the response is unsent, else through the spool."""
        assert message is not None  # a2wsgi sends None only from the loop, to end the sender
        self.pending.append(message)
        self.pending_bytes += _body_size(message)
        if self.pending_bytes < FLUSH_BYTES or not cast(dict[str, Any], message).get("more_body"):
            return  # the end of the response goes back with the thread's return
        batch, size = self.pending, self.pending_bytes
        self.pending, self.pending_bytes = [], 0
        with self.room:
            if self.failed is not None:
                raise ClientGone("the client went away during the response")
            in_memory = not self.unsent or self.unsent + size <= UNSENT_BYTES_MAX
            if in_memory:
                self.unsent += size
        if not in_memory:
            spooled = self._spill(batch, size)
            if spooled is not None:
                self.loop.call_soon_threadsafe(self._deliver, spooled)
                return
            with self.room:  # no room in the process's spools (or no spool): wait for the client
                while self.unsent > UNSENT_BYTES_MAX and self.failed is None:
                    self.room.wait()
                if self.failed is not None:
                    raise ClientGone("the client went away during the response")
                self.unsent += size
        self.loop.call_soon_threadsafe(self._deliver, batch)

    def _spill(self, batch: list[SendEvent], size: int) -> _Spooled | None:
        """The batch's bytes appended to the spool, or None where they cannot be. Written
        outside `room`, which the loop takes after every batch it sends, so that a slow disk
        holds back this thread and never the loop."""
        if self.spool_failed or not all(_is_body_part(m) for m in batch):
            return None
        with self.room:
            if self.failed is not None:
                raise ClientGone("the client went away during the response")
            if not self.budget.try_take(size):
                return None
            self.writing = True
            start = self.spool_end
        written = False
        try:
            if self.spool is None:
                self.spool = tempfile.TemporaryFile(prefix="thinkbatch-response-")  # noqa: SIM115
            data = memoryview(b"".join(cast(dict[str, Any], m)["body"] for m in batch))
            done = 0
            while done < size:  # a full disk writes what fits, then fails
                step = os.pwrite(self.spool.fileno(), data[done:], start + done)
                if step <= 0:
                    raise OSError(errno.ENOSPC, "the spool took no more bytes")
                done += step
            written = True
        except OSError:
            pass  # a full or failing temporary directory: see below
        with self.room:
            self.writing = False
            if self.ended:  # the request ended while this thread wrote: the spool is its own
                self._close_spool()
                self.budget.give_back(size)
                raise ClientGone("the request ended before its response")
            if not written:
                # This response then waits for its client, as with no spool, rather than fail
                # part-way; what the write left past the spool's end is never read.
                self.budget.give_back(size)
                self.spool_failed = True
                return None
            self.spool_end = start + size
            self.spooled += size
        return _Spooled(start, size)

    def _close_spool(self) -> None:
        """Under `room`: the spool closed and its unsent bytes' room given back."""
        if self.spool is not None:
            self.spool.close()
            self.spool = None
        self.budget.give_back(self.spooled)
        self.spooled = 0

    def _deliver(self, batch: list[SendEvent] | _Spooled) -> None:
        """On the loop: queue a batch, starting the sender on the first."""
        if self.ended:
            return
        if self.batches is None:
            assert self.client_send is not None
            self.batches = asyncio.Queue()
            self.sender_task = self.loop.create_task(self.sender(self.batches, self.client_send))
        self.batches.put_nowait(batch)

    async def sender(  # type: ignore[override]  # a2wsgi's takes only `send`
        self, batches: asyncio.Queue[list[SendEvent] | _Spooled | None], send: Send
    ) -> None:
        try:
            while (batch := await batches.get()) is not None:
                if isinstance(batch, _Spooled):
                    await self._send_spooled(send, batch)
                    continue
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

    async def _send_spooled(self, send: Send, run: _Spooled) -> None:
        offset, end = run.start, run.start + run.size
        while offset < end:
            with self.room:  # the request's end closes the spool under this lock
                if self.spool is None:
                    raise ClientGone("the request ended before its response")
                data = os.pread(self.spool.fileno(), min(FLUSH_BYTES, end - offset), offset)
            if not data:  # never: only what was written in full is sent
                raise OSError(errno.EIO, "the response's spool ended before its bytes")
            await send({"type": "http.response.body", "body": data, "more_body": True})
            offset += len(data)
            with self.room:
                self.spooled -= len(data)
                self.budget.give_back(len(data))


def _body_size(message: SendEvent) -> int:
    return len(cast(dict[str, Any], message).get("body", b""))


def _is_body_part(message: SendEvent) -> bool:
    fields = cast(dict[str, Any], message)
    return fields["type"] == "http.response.body" and bool(fields.get("more_body"))


class BatchedWSGIMiddleware(WSGIMiddleware):
    """a2wsgi's middleware with `Responder` for HTTP requests: a quick request on one of
    `workers` threads, a bulk one (api/lanes.py) on one of `bulk_workers` (0: the same pool),
    their spools within `spool_max_bytes` for the process."""

    def __init__(
        self, app: WSGIApp, workers: int = 10, bulk_workers: int = 0, spool_max_bytes: int = 0
    ) -> None:
        super().__init__(app, workers=workers)
        self.bulk_executor = (
            ThreadPoolExecutor(thread_name_prefix="WSGI-bulk", max_workers=bulk_workers)
            if bulk_workers
            else self.executor
        )
        self.budget = SpoolBudget(spool_max_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            executor = self.bulk_executor if is_bulk(scope) else self.executor
            responder = Responder(self.app, executor, self.send_queue_size, self.budget)
            await responder(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
