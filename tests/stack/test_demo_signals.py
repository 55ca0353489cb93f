"""`python -m demo --serve` stopped by SIGTERM (timeout, systemd, a container runtime) or SIGHUP
(the terminal went away) stops everything it started, as on Ctrl-C.

The launcher runs for real, with its embedded PostgreSQL and Redis, the API, Flower and a worker;
the fake engine keeps it quick (the vLLM engine is stopped the same way, as the worker's child).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow  # real processes: left out of make check

# Settings the launcher would otherwise take from this environment.
_CLEARED = ("DATABASE_URL", "REDIS_URL", "ENGINE", "MODEL", "DATA_DIR", "SERVED_MODEL_NAME")


def _wait_for(path: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = path.read_text(errors="replace") if path.exists() else ""
        if text in out:
            return
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}):\n{out[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} after {timeout}s:\n{out[-3000:]}")


def _stack_processes(launcher: int, data_dir: Path) -> list[psutil.Process]:
    """Everything the launcher started: its descendants, and the PostgreSQL server with its
    backends (pg_ctl detaches the server from the launcher)."""
    procs = psutil.Process(launcher).children(recursive=True)
    pidfile = data_dir / "postgres" / "postmaster.pid"
    postmaster = psutil.Process(int(pidfile.read_text().split()[0]))
    return [*procs, postmaster, *postmaster.children(recursive=True)]


@pytest.fixture(scope="module")
def data_dir() -> Iterator[Path]:
    # Shared by both runs (the second skips initdb). Outside pytest's base temp folder: as
    # root, PostgreSQL runs as its own user, and another pytest session on this machine
    # resets that folder to 0700, locking the server (and pg_ctl stop) out of its data.
    path = Path(tempfile.mkdtemp(prefix="thinkbatch-demo-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_stops_everything_the_launcher_started(
    data_dir: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(
        THINKBATCH_ENGINE="fake",
        THINKBATCH_MODEL="test/fake-model",
        THINKBATCH_DATA_DIR=str(data_dir),
    )
    out = tmp_path / "launcher.out"
    with out.open("wb") as sink:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "demo", "--serve"],
            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=True,  # as under a service manager: no terminal's Ctrl-C
        )  # fmt: skip
    stack: list[psutil.Process] = []
    try:
        _wait_for(out, "services are up", launcher, timeout=240)
        stack = _stack_processes(launcher.pid, data_dir)
        names = " ".join(" ".join(p.cmdline()) for p in stack)
        for part in ("postgres", "redis-server", "gunicorn", "flower", "celery"):
            assert part in names, (part, names)

        launcher.send_signal(sig)
        code = launcher.wait(120)
        _, alive = psutil.wait_procs(stack, timeout=30)
        assert alive == [], (
            [" ".join(p.cmdline()) for p in alive],
            out.read_text(errors="replace")[-1500:],
        )
        assert code == 128 + sig, out.read_text(errors="replace")[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for p in stack:  # whatever the launcher left behind, so later tests start clean
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
