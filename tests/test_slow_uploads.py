"""Slow clients against a real gunicorn: ten uploads that stall half-way through their bodies
must not keep anyone else waiting, and each is cut off once it has been silent too long."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from devstack.stack import Proc
from devstack.stack import Stack
from tests.helpers import TENANT
from tests.helpers import make_key
from thinkbatch.settings import Settings

pytestmark = pytest.mark.slow  # real processes: left out of make check

READ_TIMEOUT_S = 3


@pytest.fixture
def api(settings: Settings, db: sa.Engine, tmp_path: Path) -> Iterator[Proc]:
    stack = Stack(
        {
            "THINKBATCH_DATABASE_URL": settings.require_database_url(),
            "THINKBATCH_REDIS_URL": settings.require_redis_url(),
            "THINKBATCH_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        },
        tmp_path,
    )
    try:
        yield stack.start_api()
    finally:
        stack.stop_all()


def stall(port: int, key: str) -> socket.socket:
    """Headers and half a body of a valid, authenticated submit, then nothing."""
    body = json.dumps({"items": [{"prompt": "x" * 1000}]}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body[: len(body) // 2]
    )
    return sock


def test_stalled_uploads_do_not_block_others(api: Proc, db: sa.Engine) -> None:
    assert api.port is not None
    base = f"http://127.0.0.1:{api.port}"
    key = make_key(db, TENANT)
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(4):  # warm: each process has its database connections (not what is measured)
        warm = httpx.post(
            f"{base}/v1/jobs", json={"items": [{"prompt": "warm"}]}, headers=auth, timeout=30
        )
        assert warm.status_code == 201, warm.text
    stalled = [stall(api.port, key) for _ in range(10)]
    try:
        time.sleep(0.5)  # every stalled request is now inside a worker, waiting for its body
        # 1 s is safe on a loaded 2-core host: a served request takes tens of milliseconds, and
        # a blocked one would wait for a stalled thread, i.e. READ_TIMEOUT_S (3 s) at least.
        for _ in range(3):  # new connections, as new clients would open them
            start = time.monotonic()
            assert httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200
            assert time.monotonic() - start < 1.0
            start = time.monotonic()
            submitted = httpx.post(
                f"{base}/v1/jobs", json={"items": [{"prompt": "hello"}]}, headers=auth, timeout=1.0
            )
            assert submitted.status_code == 201, submitted.text
            assert time.monotonic() - start < 1.0
        # A silent client is answered 408 and let go once REQUEST_READ_TIMEOUT_S has passed.
        deadline = time.monotonic() + READ_TIMEOUT_S + 5
        for sock in stalled:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 408"), head[:200]
            rest = b""
            while chunk := sock.recv(65536):  # then the server closes the connection
                rest += chunk
            assert b"HTTP/1.1" not in rest
    finally:
        for sock in stalled:
            sock.close()
    with db.connect() as conn:  # only the complete submits were stored
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 4 + 3


def test_a_trickling_upload_is_cut_off(api: Proc, db: sa.Engine) -> None:
    """A byte every second never trips the per-read timeout; the minimum rate ends it."""
    assert api.port is not None
    key = make_key(db, TENANT)
    sock = stall(api.port, key)  # headers and half a body...
    try:
        sock.settimeout(1.0)
        started = time.monotonic()
        head = b""
        while not head and time.monotonic() - started < READ_TIMEOUT_S + 20:
            try:
                sock.sendall(b" ")  # ...then a byte a second: JSON whitespace, a valid body
            except OSError:
                break  # the server closed its side
            try:
                head = sock.recv(65536)
            except TimeoutError:
                continue
        assert head.startswith(b"HTTP/1.1 408"), head[:300]
        sock.settimeout(10)
        while b"}}" not in head and (chunk := sock.recv(65536)):
            head += chunk
        assert b"too slowly" in head, head
        assert time.monotonic() - started < READ_TIMEOUT_S + 10
    finally:
        sock.close()
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar() == 0
