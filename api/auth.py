"""Who is calling: every request but the few marked `public` needs `Authorization: Bearer <key>`
(what the openai SDK sends). The caller's tenant is then in `caller()`, and the job service scopes
every query by it.

Deny by default: a route added later is protected unless it is marked public, and a test walks
the app's URL map to hold that.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import redis
from flask import Flask
from flask import current_app
from flask import g
from flask import request

from thinkbatch.keys import LOCAL
from thinkbatch.keys import Caller
from thinkbatch.keys import verify_key

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., object])
# Longer than any key we issue (46 characters) by a wide margin; a longer header is refused
# before it is hashed or looked up.
MAX_KEY_CHARS = 256
FAILURE_WINDOW_S = 60
# Addresses an API process remembers as having no failed authentication this minute.
CLEAN_ADDRESSES = 10_000


class Unauthorized(Exception):
    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(message)
        self.message = message
        self.code = code


class TooManyFailures(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"too many failed authentication attempts; retry in {retry_after} s")
        self.retry_after = retry_after


def public(view: F) -> F:
    """Mark a view as open to anonymous callers (probes and metrics only)."""
    # A marker on the view function itself, read back by is_public.
    view._thinkbatch_public = True  # type: ignore[attr-defined]  # noqa: SLF001
    return view


def browser(view: F) -> F:
    """Mark a dashboard page: its key comes from the HttpOnly cookie the login page sets (a
    browser cannot send a bearer header on a page load); without a valid one it redirects to
    the login page. JSON routes never read the cookie, so it cannot be used against them."""
    # A marker on the view function itself, read back by is_browser.
    view._thinkbatch_browser = True  # type: ignore[attr-defined]  # noqa: SLF001
    return view


def is_browser(app: Flask, endpoint: str | None) -> bool:
    view = app.view_functions.get(endpoint or "")
    return bool(getattr(view, "_thinkbatch_browser", False))


class LoginRequired(Exception):
    """A dashboard page without a valid key cookie: answered with a redirect to the login."""


KEY_COOKIE = "thinkbatch_key"


def is_public(app: Flask, endpoint: str | None) -> bool:
    view = app.view_functions.get(endpoint or "")
    return bool(getattr(view, "_thinkbatch_public", False))


def caller() -> Caller:
    """The authenticated caller of this request (set before any view runs)."""
    return g.thinkbatch_caller  # type: ignore[no-any-return]


class FailureLimiter:
    """Failed authentications per client address and minute, counted in Redis so that every
    API process shares them. A key is 256 random bits, so this is not what keeps keys safe; it
    keeps a client from using the API as a fast oracle and shows up as a clear 429.

    Most callers never fail, and asking Redis on each of their requests was a round trip per
    poll. So each process remembers the addresses Redis showed with no failure in the current
    minute (`_seen`, bounded) and asks again only after a failure of its own from that address
    (then for the rest of the minute) or in the next minute. A failure counted by another
    process is seen here at this address's next failure: per minute, an address gets at most
    the limit plus, per API process, one more failed attempt, or as many as that process was
    already serving for it at once (as before, since a check and its count are two steps)
    (tests/api/test_auth.py)."""

    def __init__(self, client: redis.Redis, limit: int, remembered: int = CLEAN_ADDRESSES):
        self.client = client
        self.limit = limit
        self.remembered = remembered
        # address -> the minute it was seen clean, or minus the minute it failed here
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def _key(self, address: str) -> tuple[str, int, int]:
        now = time.time()
        window = int(now // FAILURE_WINDOW_S)
        retry = FAILURE_WINDOW_S - int(now % FAILURE_WINDOW_S)
        return f"thinkbatch:auth-failures:{address}:{window}", window, max(1, retry)

    def check(self, address: str) -> None:
        key, window, retry = self._key(address)
        with self._lock:
            if self._seen.get(address) == window:
                return
        try:
            count = int(self.client.get(key) or 0)
        except redis.RedisError:
            log.warning("auth failure counter unavailable (Redis); not limiting")
            return
        if count >= self.limit:
            raise TooManyFailures(retry)
        if count == 0:
            # Not if it failed here meanwhile: a read from before that failure is stale.
            self._remember(address, window, unless=-window)

    def failed(self, address: str) -> None:
        key, window, _ = self._key(address)
        self._remember(address, -window)
        try:
            with self.client.pipeline() as pipe:
                pipe.incr(key)
                pipe.expire(key, FAILURE_WINDOW_S * 2)
                pipe.execute()
        except redis.RedisError:
            log.warning("auth failure counter unavailable (Redis); not counting")

    def _remember(self, address: str, mark: int, unless: int | None = None) -> None:
        with self._lock:
            if unless is not None and self._seen.get(address) == unless:
                return
            self._seen[address] = mark
            self._seen.move_to_end(address)
            while len(self._seen) > self.remembered:
                self._seen.popitem(last=False)


def _bearer() -> str:
    header = request.headers.get("Authorization")
    if header is None:
        raise Unauthorized(
            "no API key: send it as 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise Unauthorized("the Authorization header must be 'Bearer <key>'")
    key = key.strip()
    if len(key) > MAX_KEY_CHARS:
        raise Unauthorized("invalid API key")
    return key


def init_app(app: Flask) -> None:
    from api.services import request_connection
    from api.services import services

    @app.before_request
    def authenticate() -> None:
        svc = services()
        if is_public(current_app, request.endpoint):
            return
        if not svc.settings.auth_required:
            g.thinkbatch_caller = LOCAL
            return
        address = request.remote_addr or "unknown"
        limiter: FailureLimiter = app.extensions["thinkbatch_auth"]
        limiter.check(address)
        if is_browser(current_app, request.endpoint):
            key = request.cookies.get(KEY_COOKIE, "")
            found = None
            if key and len(key) <= MAX_KEY_CHARS:
                found = verify_key(request_connection(), key)
                if found is None:
                    limiter.failed(address)
            if found is None:
                raise LoginRequired()
            g.thinkbatch_caller = found
            return
        try:
            key = _bearer()
            found = verify_key(request_connection(), key)
            if found is None:
                raise Unauthorized("invalid API key")
        except Unauthorized:
            limiter.failed(address)
            raise
        g.thinkbatch_caller = found

    settings = app.extensions["thinkbatch"].settings
    client = redis.Redis.from_url(
        settings.require_redis_url(), socket_timeout=1, socket_connect_timeout=1
    )
    app.extensions["thinkbatch_auth"] = FailureLimiter(client, settings.auth_failures_per_minute)
