"""gunicorn's asyncio worker with the two bounds on connections it lacks
(`worker_class = "api.server.Worker"`, api/gunicorn.conf.py).

- API_MAX_CONNECTIONS: gunicorn 27's asyncio worker counts its connections
  (`worker_connections`) but accepts every new one whatever the count. Here a connection over
  the bound is closed as soon as it is accepted, so that the process's sockets, and the memory
  each holds, stay bounded however many a client opens.
- REQUEST_HEADER_TIMEOUT_S: gunicorn closes a kept-alive connection whose next request does
  not come within its keep-alive timeout, but a new connection may take as long as it likes
  over its first request's line and headers, so a client that opens connections and sends
  their headers a byte at a time, or not at all, held each for good. Here the first request's
  headers must be in within the timeout, or the connection is closed. (A body's deadline is
  api/intake.py's, once the headers are in.)

Both are set on gunicorn's own protocol class, pinned with gunicorn in the lock files:
`tests/stack/test_slow_uploads.py` runs them against a real gunicorn, so that an upgrade that
changes the protocol fails there.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

from thinkbatch.settings import get_settings


class Protocol(ASGIProtocol):  # type: ignore[misc]  # gunicorn is untyped
    """One connection: closed at once over the process's bound, or when its first request's
    headers are not in within REQUEST_HEADER_TIMEOUT_S."""

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # counts it: connection_lost uncounts it
        worker = self.worker
        if worker.nr_conns > worker.worker_connections:
            transport.abort()
            return
        self._head_deadline = worker.loop.call_later(worker.header_timeout_s, self._head_timed_out)

    def _on_headers_complete(self) -> Any:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        return super()._on_headers_complete()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        super().connection_lost(exc)

    def _head_timed_out(self) -> None:
        # Dropped, not closed politely: the client is sending nothing worth an answer. Then,
        # as gunicorn's keep-alive timeout does, its connection's loop is woken to see it.
        self._head_deadline = None
        self.transport.abort()
        if self._request_ready is not None:
            self._request_ready.set()


class Worker(gasgi.ASGIWorker):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's asyncio worker, serving its connections with `Protocol`."""

    def init_process(self) -> None:
        self.header_timeout_s = get_settings().request_header_timeout_s
        # The worker's server makes its protocol by this module-level name
        # (`lambda: ASGIProtocol(self)` in gasgi._serve); this process serves no other.
        gasgi.ASGIProtocol = Protocol
        super().init_process()
