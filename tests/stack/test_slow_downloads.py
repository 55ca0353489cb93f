"""Slow and stalled readers against a real gunicorn (api/bridge.py, api/gunicorn.conf.py): a
request thread never waits for a client, so however many clients stop reading their downloads,
everyone else is served at once; a client that reads slowly still gets its download whole; one
that takes nothing for RESPONSE_WRITE_TIMEOUT_S is dropped, and what its response held (the
spool file, the socket) goes with it."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from bench.scale import fill_results
from tests.helpers import Servers
from tests.helpers import wait_until
from tests.stacks import RunningStack
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes: left out of make check

THREADS = 2  # API_BULK_THREADS of the one API process: a few stalled clients would take them all
WRITE_TIMEOUT_S = 3
# With thinking, a record is about 870 bytes: a download of about 17 MB, many times what a
# response may keep in memory (1 MiB) and what the sockets' buffers hold (up to 4 MiB a
# socket on Linux's defaults).
ITEMS = 20_000


@pytest.fixture(scope="module")
def api(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("slow_downloads")
    spool_dir = tmp / "spool"  # the API's TMPDIR: its spool files, found by their open fds
    spool_dir.mkdir()
    with running_stack(
        servers,
        tmp,
        "slow_downloads",
        workers=(),
        THINKBATCH_API_WORKERS="1",
        THINKBATCH_API_BULK_THREADS=str(THREADS),
        THINKBATCH_RESPONSE_WRITE_TIMEOUT_S=str(WRITE_TIMEOUT_S),
        TMPDIR=str(spool_dir),
    ) as running:
        key = running.key()
        auth = {"Authorization": f"Bearer {key}"}
        items = [{"custom_id": f"r{k}", "prompt": f"question {k}"} for k in range(ITEMS)]
        made = httpx.post(
            f"{running.base_url}/v1/jobs", json={"items": items}, headers=auth, timeout=60
        )
        assert made.status_code == 201, made.text
        job_id = made.json()["id"]
        fill_results(running.database_url, job_id)
        small = httpx.post(
            f"{running.base_url}/v1/jobs", json={"items": items[:10]}, headers=auth, timeout=60
        )
        assert small.status_code == 201, small.text
        fill_results(running.database_url, small.json()["id"])
        yield {
            "running": running, "key": key, "auth": auth, "job": job_id,
            "small": small.json()["id"], "spool": spool_dir,
        }  # fmt: skip


def _worker(running: RunningStack) -> psutil.Process:
    """The API's one gunicorn worker process (the master serves no request)."""
    assert running.api is not None
    master = psutil.Process(running.api.pid)
    (worker,) = master.children()
    return worker


def _spool_files(worker: psutil.Process, spool_dir: Path) -> int:
    """Spool files the process holds open: unnamed temporary files (O_TMPFILE, shown as
    `#inode (deleted)`) in its TMPDIR, where gunicorn and the metrics keep named ones."""
    count = 0
    for fd in Path(f"/proc/{worker.pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:
            continue  # closed meanwhile
        count += target.startswith(f"{spool_dir}/#")
    return count


def _stalled_download(port: int, key: str, job_id: str) -> socket.socket:
    """A download asked for and never read: a small receive buffer (set before connecting, so
    that the window is small from the start) fills, and the server's writes stall."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        f"GET /v1/jobs/{job_id}/results HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {key}\r\n\r\n".encode()
    )
    return sock


# A served request takes milliseconds here, also beside the slow tier's other tests; a blocked
# one waits until the stalled clients are dropped: RESPONSE_WRITE_TIMEOUT_S and the server's
# disconnect grace (3 s), over 5 s in all.
FAST_S = 2.0


def _served_fast(base: str, auth: dict[str, str], paths: tuple[str, ...]) -> None:
    """Each path answered 200 on a new connection within FAST_S."""
    for path in paths:
        start = time.monotonic()
        answer = httpx.get(f"{base}{path}", headers=auth, timeout=FAST_S)
        assert answer.status_code == 200, (path, answer.text)
        assert time.monotonic() - start < FAST_S, path


def test_stalled_downloads_hold_no_thread_and_are_dropped(api: dict[str, Any]) -> None:
    running, key, auth, job_id = api["running"], api["key"], api["auth"], api["job"]
    assert running.api is not None and running.api.port is not None
    port, base = running.api.port, running.base_url
    worker = _worker(running)
    quick = ("/healthz", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/items?limit=100")
    # Another job's download, on the bulk lane the stalled ones are on (api/lanes.py).
    bulk = (f"/v1/jobs/{api['small']}/results",)
    _served_fast(base, auth, quick + bulk)  # warm: the process's connections and statements
    stalled = [_stalled_download(port, key, job_id) for _ in range(3 * THREADS)]
    ports = {s.getsockname()[1] for s in stalled}
    try:
        _served_fast(base, auth, quick)  # while the bulk lane makes the stalled downloads
        # Each stalled response is made in full, at the database's pace, into a spool of its
        # own; its thread is then free, though its client has taken almost nothing.
        wait_until(
            lambda: _spool_files(worker, api["spool"]) == len(stalled),
            30,
            "a spool file for each stalled download",
        )
        for _ in range(3):
            _served_fast(base, auth, quick + bulk)
        # The kernel drops each after RESPONSE_WRITE_TIMEOUT_S of taking nothing; the server
        # ends its request (its disconnect grace is 3 s) and the spool goes.
        started = time.monotonic()

        def let_go() -> bool:
            peers = {c.raddr.port for c in worker.net_connections("tcp") if c.raddr}
            return not (peers & ports) and _spool_files(worker, api["spool"]) == 0

        wait_until(let_go, WRITE_TIMEOUT_S + 15, "the stalled downloads dropped, spools gone")
        assert time.monotonic() - started >= 1.0  # not at once: after the write timeout
        _served_fast(base, auth, quick + bulk)
    finally:
        for sock in stalled:
            sock.close()


def test_a_slow_reader_gets_its_download_whole(api: dict[str, Any]) -> None:
    running, auth, job_id = api["running"], api["auth"], api["job"]
    url = f"{running.base_url}/v1/jobs/{job_id}/results"
    whole = httpx.get(url, headers=auth, timeout=60)
    assert whole.status_code == 200
    assert whole.content.count(b"\n") == ITEMS
    worker = _worker(running)
    spooled_meanwhile = False
    parts: list[bytes] = []
    with httpx.stream("GET", url, headers=auth, timeout=60) as slow:
        for chunk in slow.iter_raw(16_384):
            parts.append(chunk)
            spooled_meanwhile |= _spool_files(worker, api["spool"]) > 0
            time.sleep(0.01)  # about 1.6 MB/s: slower than the rows are made
    assert b"".join(parts) == whole.content  # every line, in order, as a fast reader got them
    assert spooled_meanwhile  # what this reader had not taken waited in the spool
    wait_until(lambda: _spool_files(worker, api["spool"]) == 0, 5, "the spool gone at the end")
