"""Request bodies: the media type is checked, and the body is read off the network in full
before any database work starts.

A client that sends half a body and stalls must cost one thread and nothing that others need:
no database transaction or connection is taken while bytes are still arriving. So the body is
spooled first (in memory up to SPOOL_MEMORY_BYTES, in a temporary file beyond, never more than
MAX_REQUEST_BYTES), with REQUEST_READ_TIMEOUT_S as the longest wait for the next bytes, and only
then parsed and stored inside the transaction.
"""

from __future__ import annotations

import socket
import tempfile
import threading
from typing import IO

from flask import request
from werkzeug.exceptions import ClientDisconnected
from werkzeug.exceptions import HTTPException
from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.exceptions import RequestTimeout
from werkzeug.exceptions import UnsupportedMediaType

from thinkbatch.settings import Settings

CHUNK = 64 * 1024
JSON = "application/json"
_UTF8 = ("utf-8", "utf8")


def require_json(*, body_required: bool = True) -> None:
    """415 unless the body is declared `application/json` (charset, if given, UTF-8).

    Browsers send `text/plain` and form bodies cross-origin without a preflight; refusing them
    keeps a web page from submitting jobs to a local API on its visitor's behalf. A route whose
    body is optional (cancel) accepts a request with no body and no Content-Type.
    """
    has_body = (
        bool(request.content_length)
        or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    )
    if not body_required and not has_body and not request.content_type:
        return
    charset = request.mimetype_params.get("charset", "utf-8").lower()
    if request.mimetype != JSON or charset not in _UTF8:
        raise UnsupportedMediaType(
            "the body must be JSON: send Content-Type: application/json (charset utf-8)"
        )


def spool(settings: Settings) -> IO[bytes]:
    """Read the whole request body into a spooled temporary file, rewound for reading."""
    sock = request.environ.get("gunicorn.socket")
    if isinstance(sock, socket.socket):
        # gunicorn's threads block on the socket with no timeout: a stalled client would hold
        # the thread for good. The timeout bounds each wait for bytes, not the whole upload, so
        # a large body on a slow but live link still gets through.
        sock.settimeout(settings.request_read_timeout_s)
    watchdog = BodyDeadline(sock, settings, request.content_length)
    out = tempfile.SpooledTemporaryFile(max_size=settings.spool_memory_bytes)  # noqa: SIM115
    try:
        stream = request.stream  # werkzeug raises 413 here when Content-Length is over the limit
        total = 0
        while chunk := stream.read(CHUNK):
            total += len(chunk)
            if total > settings.max_request_bytes:  # a chunked body has no Content-Length
                raise RequestEntityTooLarge()
            out.write(chunk)
        if watchdog.fired:  # reading was ended under the client: what came is not the body
            _stop_reading(sock)
            raise TooSlowBody(settings.request_min_bytes_per_s)
    except ClientDisconnected as error:
        out.close()
        if watchdog.fired:
            raise TooSlowBody(settings.request_min_bytes_per_s) from None
        # werkzeug reports any failed read as a disconnect; the socket timeout is its cause
        # when the client went silent (the TimeoutError is the exception's context).
        if isinstance(error.__context__, TimeoutError):
            _stop_reading(sock)
            raise _StalledBody(settings.request_read_timeout_s) from None
        raise
    except HTTPException:
        out.close()
        raise
    except TimeoutError:
        out.close()
        _stop_reading(sock)
        raise _StalledBody(settings.request_read_timeout_s) from None
    except BaseException:
        out.close()
        raise
    finally:
        watchdog.cancel()
        if isinstance(sock, socket.socket):
            try:
                sock.settimeout(None)  # gunicorn writes the response in blocking mode
            except OSError:
                pass
    out.seek(0)
    return out


class BodyDeadline:
    """The whole body's deadline: REQUEST_READ_TIMEOUT_S plus its length at
    REQUEST_MIN_BYTES_PER_S (MAX_REQUEST_BYTES when no length is declared). A client that
    trickles a byte now and then never trips the per-read timeout, and gunicorn fills a read
    before it returns, so the time is kept apart: when it is up, reading ends and the client
    gets 408."""

    def __init__(self, sock: object, settings: Settings, length: int | None):
        self.fired = False
        self.timer: threading.Timer | None = None
        if not isinstance(sock, socket.socket):
            return  # not under gunicorn (tests' WSGI client): nothing reads from a network

        def expire() -> None:
            self.fired = True
            _stop_reading(sock)

        size = length if length is not None else settings.max_request_bytes
        budget = settings.request_read_timeout_s + size / settings.request_min_bytes_per_s
        self.timer = threading.Timer(budget, expire)
        self.timer.daemon = True
        self.timer.start()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


def _stop_reading(sock: object) -> None:
    """The rest of a stalled body may still come, and the connection cannot carry another
    request: end its read side so gunicorn closes it after the 408 instead of keeping it alive
    (it drops a `Connection: close` that an app sets)."""
    if isinstance(sock, socket.socket):
        try:
            sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass


class _StalledBody(RequestTimeout):
    def __init__(self, timeout_s: float):
        super().__init__(f"the request body stalled: no bytes for {timeout_s:g} seconds")


class TooSlowBody(RequestTimeout):
    def __init__(self, min_rate: int):
        super().__init__(
            f"the request body is arriving too slowly: below {min_rate} bytes/s on average "
            "(REQUEST_MIN_BYTES_PER_S)"
        )
