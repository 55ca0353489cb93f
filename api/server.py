"""gunicorn's asyncio worker with the bounds on connections it lacks
(`worker_class = "api.server.Worker"`, api/gunicorn.conf.py).

- API_MAX_CONNECTIONS: gunicorn 27's asyncio worker counts its connections
  (`worker_connections`) but accepts every new one whatever the count. Here a connection over
  the bound is closed as soon as it is accepted, so that the process's sockets, and the memory
  each holds, stay bounded however many a client opens.
- REQUEST_HEADER_TIMEOUT_S: gunicorn closes a kept-alive connection whose next request does
  not come within its keep-alive timeout, but a new connection may take as long as it likes
  over its first request's line and headers, so a client that opens connections and sends
  their headers a byte at a time, or not at all, held each for good. Here the first request's
  headers must be in within the timeout, or the connection is dropped. (A body's deadline is
  api/intake.py's, once the headers are in.)
- RESPONSE_WRITE_TIMEOUT_S: each accepted TCP socket gets TCP_USER_TIMEOUT, the longest the
  kernel lets sent bytes go unacknowledged, a zero window (a client that stopped reading)
  included on the kernels this runs on: a client that takes none of a response for that long
  is dropped, its request ends as for a client gone, and its spool with it (api/bridge.py).
  Set per connection, not on the listening sockets, so that every way gunicorn makes its
  sockets (a worker's own with reuse_port, new ones after a reload) gets it.
- API_LOOP_STALL_S: the process's event loop is watched (api/stall.py), and where it stands
  is logged when it has not run for that long.

The first three are set on gunicorn's own protocol class, pinned with gunicorn in the lock files:
`tests/stack/test_slow_uploads.py` and `tests/stack/test_slow_downloads.py` run them against a
real gunicorn, so that an upgrade that changes the protocol fails there.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

from api.stall import LoopWatchdog
from thinkbatch.settings import get_settings


class Protocol(ASGIProtocol):  # type: ignore[misc]  # gunicorn is untyped
    """One connection: closed at once over the process's bound, dropped when its first
    request's headers are not in within REQUEST_HEADER_TIMEOUT_S, and by the kernel when its
    client takes none of a response for RESPONSE_WRITE_TIMEOUT_S."""

    _head_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # counts it: connection_lost uncounts it
        worker = self.worker
        if worker.nr_conns > worker.worker_connections:
            self._drop()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, worker.write_timeout_ms)

    def _start_http1(self, buffered: bytes = b"") -> Any:
        # Every HTTP/1 connection starts here: from connection_made, or once cleartext HTTP/2
        # sniffing has fallen back to HTTP/1.
        started = super()._start_http1(buffered)
        if self._head_deadline is None and self._request_ready is not None:
            self._head_deadline = self.worker.loop.call_later(
                self.worker.header_timeout_s, self._head_timed_out
            )
        return started

    def _on_headers_complete(self) -> Any:
        self._cancel_head_deadline()
        return super()._on_headers_complete()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        self._drop()

    def _drop(self) -> None:
        # Dropped, not closed politely: nothing the client sent is worth an answer. As
        # gunicorn's keep-alive timeout does, the connection's loop is then woken to see it,
        # rather than left for the disconnect grace period to cancel.
        self._cancel_head_deadline()
        self.transport.abort()
        if self._request_ready is not None:
            self._request_ready.set()


class Worker(gasgi.ASGIWorker):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's asyncio worker, serving its connections with `Protocol`."""

    def init_process(self) -> None:
        settings = get_settings()
        self.header_timeout_s = settings.request_header_timeout_s
        self.write_timeout_ms = max(1, round(settings.response_write_timeout_s * 1000))
        # gunicorn's C parser, when installed, is looked up once and cached on the class that
        # asks; the base class's code reads the base's cache, so the base asks first.
        ASGIProtocol._check_h1c_protocol_available()  # noqa: SLF001 - gunicorn has no public hook
        # The worker's server makes its protocol by this module-level name
        # (`lambda: ASGIProtocol(self)` in gasgi._serve); this process serves no other.
        gasgi.ASGIProtocol = Protocol
        self.stall_s = settings.api_loop_stall_s
        super().init_process()

    def run(self) -> None:
        # The loop exists by now (init_process made it) and runs in this thread from here on.
        watchdog = LoopWatchdog(self.loop, self.stall_s)
        watchdog.start()
        try:
            super().run()
        finally:
            watchdog.stop()
