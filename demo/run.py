"""`make demo`: a demo batch end to end on one machine, with embedded defaults.

Starts PostgreSQL and Redis (or uses THINKBATCH_DATABASE_URL / THINKBATCH_REDIS_URL), migrates,
builds the tiny demo model unless THINKBATCH_MODEL names another (all through devstack's
local_stack), starts the API, one worker and Flower, submits a batch built from the seed
articles' prompts, some of them also on a LoRA adapter of the demo model (two models, one
worker), shows its progress, prints every item with the model it ran on, and says where the
API and Flower listen.
"""

from __future__ import annotations

import argparse
import sys
import time
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
from devstack import LocalStack
from devstack import local_stack
from devstack.demo_model import DEMO_MODEL
from devstack.demo_model import build_demo_adapter
from devstack.demo_model import demo_adapter_env
from devstack.services import free_port
from devstack.stack import readiness_wait
from devstack.tiny_prompts import DEMO_ITEMS
from thinkbatch.settings import get_settings

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

    data_dir = get_settings().data_dir.absolute()
    with local_stack(data_dir, say=lambda line: console.print(f"[dim]{line}[/]")) as local:
        return run(local, serve)


def mixed_items(adapter: str | None) -> list[dict[str, Any]]:
    """The demo's items, and (with an adapter) the first three again on the adapter: the same
    questions, answered by the fine-tune."""
    if adapter is None:
        return DEMO_ITEMS
    again = [
        {**item, "custom_id": f"{item['custom_id']}@{adapter}", "model": adapter}
        for item in DEMO_ITEMS[:3]
    ]
    return [*DEMO_ITEMS, *again]


def run(local: LocalStack, serve: bool) -> int:
    stack, settings = local.stack, local.settings
    api_key = demo_api_key(local.database_url)
    flower_auth = flower_basic_auth(settings.data_dir.absolute())
    api = stack.start_api(port=port_or_free(8000))
    flower = stack.start_flower(flower_auth, port=port_or_free(5555))
    # Two models on one worker: the demo checkpoint and a LoRA adapter of it (peft, built once
    # and cached), which the mixed batch below names item by item.
    adapter_env: dict[str, str] = {}
    adapter = None
    if settings.model_name == DEMO_MODEL:  # the demo checkpoint, not a model of the user's
        with console.status("building the demo's LoRA adapter (once; cached)…"):
            adapter, path = build_demo_adapter(local.env)
        adapter_env = demo_adapter_env(adapter, path)
    with console.status("starting the worker (loading the model into vLLM)…") as status:
        started = time.monotonic()
        worker = stack.start_worker("worker", env=adapter_env, wait=False)
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
                "items": mixed_items(adapter),
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
    for column in ("custom_id", "model", "status", "thinking", "answer", "tokens p/c/r"):
        table.add_column(column, overflow="fold")
    for item in items:
        usage = item["usage"] or {}
        table.add_row(
            item["custom_id"],
            item["model"],
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
    # The embedded database listens on a port of its own choosing: the command names it.
    console.print(
        "a key for another tenant, while the services are up:\n"
        f"  thinkbatch keys create --tenant team-b --database-url '{local.database_url}'",
        soft_wrap=True,
    )
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
