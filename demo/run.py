"""`make demo`: a demo batch end to end on one machine, with embedded defaults.

Starts PostgreSQL and Redis (or uses DATABASE_URL / REDIS_URL), migrates, builds the tiny demo
model when MODEL is the demo model, starts the API, one worker and Flower, submits a batch
built from the seed articles' prompts, shows its progress, prints every item, and says where
the API and Flower listen.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn
from rich.progress import MofNCompleteColumn
from rich.progress import Progress
from rich.progress import TextColumn
from rich.progress import TimeElapsedColumn
from rich.table import Table

from demo.credentials import demo_api_key
from demo.credentials import flower_basic_auth
from demo.prompts import DEMO_ITEMS
from thinkbatch.local_services import LocalPostgres
from thinkbatch.local_services import LocalRedis
from thinkbatch.local_services import free_port
from thinkbatch.settings import DEMO_MODEL
from thinkbatch.settings import Settings
from thinkbatch.stack import Stack
from thinkbatch.stack import demo_model_env
from thinkbatch.stack import engine_env
from thinkbatch.stack import readiness_wait

console = Console()


def port_or_free(preferred: int) -> int:
    import socket

    with socket.socket() as sock:
        # As gunicorn binds: a port in TIME_WAIT from the last run is free to reuse.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", preferred))
            return preferred
        except OSError:
            return free_port()


def shorten(text: str | None, width: int) -> str:
    if not text:
        return ""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def start_services(settings: Settings, stack_env: dict[str, str], started: list[Any]) -> None:
    """Start the embedded PostgreSQL and Redis the settings do not point elsewhere. Each is
    recorded in `started` before it starts, so that a stop signal arriving mid-start still
    stops it (stopping one that never came up does nothing)."""
    data = settings.data_dir.absolute()
    if not settings.database_url:
        console.print(f"[dim]starting PostgreSQL (embedded) in {data / 'postgres'}[/]")
        pg = LocalPostgres(data / "postgres")
        started.append(pg)
        stack_env["DATABASE_URL"] = pg.start().create_database("thinkbatch")
    if not settings.redis_url:
        console.print("[dim]starting Redis (embedded)[/]")
        redis_server = LocalRedis(data / "redis")
        started.append(redis_server)
        stack_env["REDIS_URL"] = redis_server.start().url(0)


# Stopped by a service manager or a container runtime (SIGTERM), or by the terminal going away
# (SIGHUP): tear down as on Ctrl-C. Python's default for these ends the process at once, which
# skips every `finally` and leaves the services, each in its own session, running.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _stop_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _ignore_stop_signals() -> None:
    # A second signal (an impatient Ctrl-C, systemd repeating SIGTERM) must not cut the
    # teardown short; each stop is bounded by its own timeout and ends in SIGKILL.
    for sig in (*STOP_SIGNALS, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def stop_services(stack: Stack | None, services: list[Any]) -> None:
    if stack is not None:
        stack.stop_all()
    for service in reversed(services):
        try:
            service.stop()
        except Exception as error:  # noqa: BLE001 - stop the others all the same
            console.print(f"[red]could not stop {type(service).__name__}: {error}[/]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep the services up after the demo (default: when interactive)",
    )
    args = parser.parse_args(argv)
    serve = sys.stdin.isatty() if args.serve is None else args.serve

    settings = Settings()
    env = {**engine_env(), **demo_model_env(settings)}
    settings = settings.model_copy(update={"model": env.get("MODEL", settings.model)})
    services: list[Any] = []
    stack: Stack | None = None
    for sig in STOP_SIGNALS:
        signal.signal(sig, _stop_on_signal)
    try:
        start_services(settings, env, services)
        stack = Stack(env, settings.data_dir.absolute() / "logs")
        return run(stack, settings, serve)
    finally:
        _ignore_stop_signals()
        stop_services(stack, services)


def run(stack: Stack, settings: Settings, serve: bool) -> int:
    console.print("[dim]migrating the database[/]")
    subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"], env=stack.env, check=True,
        cwd=Path(__file__).resolve().parent.parent, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    if settings.model == DEMO_MODEL:
        console.print("[dim]building the tiny demo model (once; cached)[/]")
        subprocess.run([sys.executable, "-m", "demo.model"], env=stack.env, check=True)
    api_key = demo_api_key(stack.env.get("DATABASE_URL") or settings.require_database_url())
    flower_auth = flower_basic_auth(settings.data_dir.absolute())
    api = stack.start_api(port=port_or_free(8000))
    flower = stack.start_flower(flower_auth, port=port_or_free(5555))
    with console.status("starting the worker (loading the model into vLLM)…") as status:
        started = time.monotonic()
        worker = stack.start_worker("worker", wait=False)
        stack.wait_worker_ready(
            worker,
            **readiness_wait(settings),
            on_status=lambda line: status.update(f"starting the worker: {line}"),
        )
    console.print(f"worker ready in {time.monotonic() - started:.0f} s")

    base = f"http://127.0.0.1:{api.port}"
    client = httpx.Client(base_url=base, timeout=60, headers={"Authorization": f"Bearer {api_key}"})
    submitted = time.monotonic()
    job = (
        client.post(
            "/v1/jobs",
            json={
                "params": {"max_tokens": 256},
                "items": DEMO_ITEMS,
                "metadata": {"source": "make demo"},
            },
        )
        .raise_for_status()
        .json()
    )
    console.print(f"submitted job [bold]{job['id']}[/] with {job['counts']['total']} items")

    with Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console,
    ) as progress:  # fmt: skip
        bar = progress.add_task("running", total=job["counts"]["total"])
        while job["status"] in ("queued", "running", "cancelling"):
            time.sleep(0.5)
            job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
            c = job["counts"]
            progress.update(
                bar,
                completed=c["succeeded"] + c["failed"] + c["cancelled"] + c["expired"],
                description=job["status"],
            )
    elapsed = time.monotonic() - submitted

    items = client.get(f"/v1/jobs/{job['id']}/items", params={"limit": 1000}).json()["data"]
    table = Table(title=f"job {job['id']}: {job['status']}", show_lines=True)
    for column in ("custom_id", "status", "thinking", "answer", "tokens p/c/r"):
        table.add_column(column, overflow="fold")
    for item in items:
        usage = item["usage"] or {}
        table.add_row(
            item["custom_id"],
            item["status"],
            shorten(item["thinking"], 40),
            shorten(item["answer"] or (item["error"] or {}).get("message"), 60),
            "/".join(str(usage.get(k, "-")) for k in
                     ("prompt_tokens", "completion_tokens", "reasoning_tokens")),
        )  # fmt: skip
    console.print(table)
    c, u = job["counts"], job["usage"]
    console.print(
        f"totals: {c['succeeded']} succeeded, {c['failed']} failed of {c['total']} in "
        f"{elapsed:.1f} s; tokens: {u['prompt_tokens']} prompt, {u['completion_tokens']} "
        f"completion ({u['reasoning_tokens']} reasoning)"
    )
    console.print(f"API:    {base}")
    console.print(f"API key (tenant demo): {api_key}")
    console.print(f'  try: curl -H "Authorization: Bearer {api_key}" {base}/v1/jobs/{job["id"]}')
    console.print(f"Flower: http://127.0.0.1:{flower.port}   (basic auth {flower_auth})")
    console.print(f"logs:   {stack.log_dir}")
    if serve:
        console.print("[bold]services are up; press Ctrl-C to stop them[/]")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    return 0 if job["status"] == "completed" and c["failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
