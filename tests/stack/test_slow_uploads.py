"""Slow and stalled clients against a real gunicorn: however many bodies trickle in, and in
whatever framing, nobody else waits for them, and each is cut off as soon as the rule says
(api/intake.py): no bytes for REQUEST_READ_TIMEOUT_S, or less than its received bytes at
REQUEST_MIN_BYTES_PER_S beyond that, whatever size it declared."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.helpers import Servers
from tests.helpers import wait_until
from tests.stacks import RunningStack
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes: left out of make check

READ_TIMEOUT_S = 3
UPLOADS_PER_CLIENT = 4


def _api(servers: Servers, tmp_path: Path, **env: str) -> AbstractContextManager[RunningStack]:
    """The API alone (bodies are all these tests send), with a short read timeout."""
    settings = {
        "THINKBATCH_REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S),
        "THINKBATCH_MAX_UPLOADS_PER_CLIENT": str(UPLOADS_PER_CLIENT),
        **env,
    }
    return running_stack(servers, tmp_path, "slow_uploads", workers=(), **settings)


@pytest.fixture
def api(servers: Servers, tmp_path: Path) -> Iterator[RunningStack]:
    with _api(servers, tmp_path) as running:
        yield running


def _body() -> bytes:
    return json.dumps({"items": [{"prompt": "x" * 1000}]}).encode()


def stall(
    port: int, key: str, *, chunked: bool = False, source: str = "127.0.0.1", declared: int = 0
) -> socket.socket:
    """Headers and half a body of a valid, authenticated submit, then nothing. `declared`
    claims a larger Content-Length than the body (a client announcing a huge upload)."""
    body = _body()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    head = (
        b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
    )
    if chunked:
        half = body[: len(body) // 2]
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n" + _chunk(half))
    else:
        length = declared or len(body)
        sock.sendall(head + f"Content-Length: {length}\r\n\r\n".encode() + body[: len(body) // 2])
    return sock


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _trickle(sock: socket.socket, chunked: bool) -> bool:
    """One byte of JSON whitespace (a valid body, only slow); False once the server closed."""
    try:
        sock.sendall(_chunk(b" ") if chunked else b" ")
        return True
    except OSError:
        return False


def _answer(sock: socket.socket, timeout: float) -> bytes:
    """The response on a connection, read until the server closes it."""
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _served_fast(base: str, auth: dict[str, str]) -> None:
    """/healthz and a small submit on new connections, each answered within 1 s.

    1 s is safe on a loaded 2-core host: a served request takes tens of milliseconds, and a
    blocked one would wait for a stalled body, i.e. READ_TIMEOUT_S (3 s) at least."""
    start = time.monotonic()
    assert httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200
    assert time.monotonic() - start < 1.0
    start = time.monotonic()
    submitted = httpx.post(
        f"{base}/v1/jobs", json={"items": [{"prompt": "hello"}]}, headers=auth, timeout=1.0
    )
    assert submitted.status_code == 201, submitted.text
    assert time.monotonic() - start < 1.0


def _port(api: RunningStack) -> int:
    assert api.api is not None and api.api.port is not None
    return api.api.port


def _jobs(db: sa.Engine) -> int:
    with db.connect() as conn:
        return int(conn.execute(sa.text("SELECT count(*) FROM jobs")).scalar_one())


def test_stalled_uploads_do_not_block_others(api: RunningStack) -> None:
    base, key, db = api.base_url, api.key(), api.db
    port = _port(api)
    auth = {"Authorization": f"Bearer {key}"}
    for _ in range(4):  # warm: each process has its database connections (not what is measured)
        warm = httpx.post(
            f"{base}/v1/jobs", json={"items": [{"prompt": "warm"}]}, headers=auth, timeout=30
        )
        assert warm.status_code == 201, warm.text
    # Ten silent bodies from ten client addresses (127/8 is all loopback): the per-address cap
    # does not come into it.
    stalled = [stall(port, key, source=f"127.0.1.{n + 1}") for n in range(10)]
    try:
        time.sleep(0.5)
        for _ in range(3):
            _served_fast(base, auth)
        # A silent client is answered 408 and let go once REQUEST_READ_TIMEOUT_S has passed.
        deadline = time.monotonic() + READ_TIMEOUT_S + 5
        for sock in stalled:
            answer = _answer(sock, max(0.1, deadline - time.monotonic()))
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"stalled" in answer
            assert answer.count(b"HTTP/1.1") == 1  # then the server closed the connection
    finally:
        for sock in stalled:
            sock.close()
    assert _jobs(db) == 4 + 3  # only the complete submits were stored


def test_fifty_trickling_clients_of_both_framings(servers: Servers, tmp_path: Path) -> None:
    """50 clients, each from its own address, half of them chunked and half declaring a 256 MiB
    Content-Length, all sending a byte now and then: more than the API's threads (2 processes x
    API_THREADS and API_BULK_THREADS, 4 each). The API still answers at once, and each is cut
    off by the rate."""
    read_timeout = 10  # long enough to measure while all 50 hold their connections
    with _api(servers, tmp_path, THINKBATCH_REQUEST_READ_TIMEOUT_S=str(read_timeout)) as api:
        _trickle_fifty(api, read_timeout)


def _trickle_fifty(api: RunningStack, read_timeout: int) -> None:
    base, key, db, port = api.base_url, api.key(), api.db, _port(api)
    auth = {"Authorization": f"Bearer {key}"}
    slow: list[tuple[socket.socket, bool]] = []
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(1.0):
            for sock, chunked in slow:
                _trickle(sock, chunked)

    feeder = threading.Thread(target=trickle, daemon=True)
    try:
        httpx.post(f"{base}/v1/jobs", json={"items": [{"prompt": "w"}]}, headers=auth, timeout=30)
        started = time.monotonic()
        for n in range(50):
            chunked = n % 2 == 0
            sock = stall(
                port,
                key,
                chunked=chunked,
                source=f"127.0.2.{n + 1}",
                declared=0 if chunked else 256 * 1024 * 1024,
            )
            slow.append((sock, chunked))
        feeder.start()
        time.sleep(1.0)
        assert time.monotonic() - started < read_timeout - 3  # all 50 still held
        for _ in range(3):
            _served_fast(base, auth)
        assert time.monotonic() - started < read_timeout  # ...while they were
        # Each is cut off once it has used up REQUEST_READ_TIMEOUT_S plus its few bytes at the
        # minimum rate: about read_timeout, not the hours 256 MiB (or no length) would allow.
        for sock, _ in slow:
            answer = _answer(sock, max(0.1, started + read_timeout + 10 - time.monotonic()))
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b"too slowly" in answer, answer
        assert time.monotonic() - started < read_timeout + 10
    finally:
        stop.set()
        if feeder.is_alive():
            feeder.join(5)  # no thread of a test outlives it
        for sock, _ in slow:
            sock.close()
    assert _jobs(db) == 1 + 3


def test_uploads_per_client_address_are_capped(servers: Servers, tmp_path: Path) -> None:
    """One address may send MAX_UPLOADS_PER_CLIENT bodies to a process at once; the next is
    refused at once with 429 and Retry-After, another address is not affected, and the cap
    frees up as the bodies end."""
    with _api(servers, tmp_path, THINKBATCH_API_WORKERS="1") as api:  # the cap is per process
        _capped(api)


def _capped(api: RunningStack) -> None:
    base, key, db, port = api.base_url, api.key(), api.db, _port(api)
    held = [stall(port, key, source="127.0.3.1") for _ in range(UPLOADS_PER_CLIENT)]
    try:
        time.sleep(0.3)
        extra = stall(port, key, source="127.0.3.1", chunked=True)
        answer = _answer(extra, 2.0)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 429"), answer[:200]
        assert b"retry-after:" in answer.lower()
        assert b"MAX_UPLOADS_PER_CLIENT" in answer
        other = httpx.post(  # from 127.0.0.1: its own count
            f"{base}/v1/jobs",
            json={"items": [{"prompt": "hello"}]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=5,
        )
        assert other.status_code == 201, other.text
        for sock in held:  # the held bodies end (stalled out), and the address may send again
            assert _answer(sock, READ_TIMEOUT_S + 5).startswith(b"HTTP/1.1 408")
        again = stall(port, key, source="127.0.3.1")
        again.sendall(_body()[len(_body()) // 2 :])
        assert _answer(again, 5).startswith(b"HTTP/1.1 201")
        again.close()
    finally:
        for sock in held:
            sock.close()
    assert _jobs(db) == 2


def test_a_trickling_file_upload_is_cut_off(api: RunningStack) -> None:
    """The same rule holds on /v1/files, a multipart body sent chunked."""
    key, db = api.key(), api.db
    sock = socket.create_connection(("127.0.0.1", _port(api)), timeout=10)
    part = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    )
    sock.sendall(
        b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\n"
        + f"Authorization: Bearer {key}\r\n".encode()
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + _chunk(part)
    )
    started = time.monotonic()
    try:
        while _trickle(sock, chunked=True) and time.monotonic() - started < READ_TIMEOUT_S + 10:
            sock.settimeout(1.0)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    break
            except TimeoutError:
                continue
        answer = _answer(sock, 5)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
        assert b"too slowly" in answer
        assert time.monotonic() - started < READ_TIMEOUT_S + 5
    finally:
        sock.close()
    with db.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM files")).scalar() == 0


def _closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes the connection within `timeout` (nothing sent back)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_connection_that_never_finishes_its_headers_is_dropped(
    servers: Servers, tmp_path: Path
) -> None:
    """Clients that connect and send nothing, or their first request's headers a byte now and
    then, hold their connections only for REQUEST_HEADER_TIMEOUT_S; /healthz is answered
    meanwhile."""
    header_timeout = 2
    env = {"THINKBATCH_REQUEST_HEADER_TIMEOUT_S": str(header_timeout)}
    with _api(servers, tmp_path, **env) as api:
        port = _port(api)
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
        partial = []
        for n in range(5):
            sock = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(f"127.0.3.{n + 1}", 0)
            )
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            partial.append(sock)
        try:
            started = time.monotonic()
            assert httpx.get(f"{api.base_url}/healthz", timeout=1.0).status_code == 200
            for sock in partial:  # a header line now and then: not enough
                sock.sendall(b"X-Slow: 1\r\n")
            for sock in silent + partial:
                assert _closed_by_server(sock, header_timeout + 5 - (time.monotonic() - started))
            assert time.monotonic() - started >= header_timeout - 0.5
            assert httpx.get(f"{api.base_url}/healthz", timeout=1.0).status_code == 200
        finally:
            for sock in silent + partial:
                sock.close()


def test_connections_over_the_bound_are_closed_as_they_come(
    servers: Servers, tmp_path: Path
) -> None:
    """API_MAX_CONNECTIONS holds: the one API process keeps that many connections open and
    closes any more as soon as it accepts them; once they go, it serves again."""
    bound = 20
    env = {"THINKBATCH_API_MAX_CONNECTIONS": str(bound), "THINKBATCH_API_WORKERS": "1"}
    with _api(servers, tmp_path, **env) as api:
        port = _port(api)
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(bound)]
        try:
            time.sleep(0.5)  # every one of them accepted
            for sock in held:
                assert not _closed_by_server(sock, 0.05)  # kept: within the bound
            extra = socket.create_connection(("127.0.0.1", port), timeout=10)
            extra.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _closed_by_server(extra, 5)  # over it: closed, unanswered
            extra.close()
        finally:
            for sock in held:
                sock.close()
        wait_until(lambda: _healthz_ok(api.base_url), 5, "served again once the connections went")


def _healthz_ok(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def _healthz_on(sock: socket.socket) -> bytes:
    """One /healthz on a kept-alive connection: its response's status line and headers."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    sock.settimeout(5)
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = sock.recv(65536)
        assert chunk, out  # the server closed the connection instead of answering
        out += chunk
    head, _, rest = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += sock.recv(65536)
    return head


def test_a_kept_alive_connection_outlasts_the_clients_idle_timeouts(
    servers: Servers, tmp_path: Path
) -> None:
    """The API keeps an idle connection open for API_KEEPALIVE_S, longer than a client pool
    keeps it (httpx reuses one idle for up to 5 s): a pool's request on a connection it still
    holds is answered, not met by the server's close; past API_KEEPALIVE_S it is closed."""
    keepalive = 8
    env = {"THINKBATCH_API_KEEPALIVE_S": str(keepalive), "THINKBATCH_API_WORKERS": "1"}
    with _api(servers, tmp_path, **env) as api:
        sock = socket.create_connection(("127.0.0.1", _port(api)), timeout=10)
        try:
            assert _healthz_on(sock).startswith(b"HTTP/1.1 200")
            time.sleep(6)  # past httpx's idle expiry (5 s), within the API's keep-alive
            assert _healthz_on(sock).startswith(b"HTTP/1.1 200")
            idle_from = time.monotonic()
            assert _closed_by_server(sock, keepalive + 5)
            assert time.monotonic() - idle_from >= keepalive - 0.5
        finally:
            sock.close()
