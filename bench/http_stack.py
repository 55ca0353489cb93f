"""What the WSGI bridge costs the API per request (`python -m bench.http_stack`).

Two gunicorn APIs of one worker each, as api/gunicorn.conf.py runs them, over the same database:
`batched`, the API as shipped (api/asgi.py: a2wsgi with api.bridge's Responder, a response
handed back in batches), and `a2wsgi`, the same app behind a2wsgi's own responder, a round
trip to the event loop for every message of a response. For each of /healthz, a status call of
a queued 100-item job and an items page of 100, one client sends `--calls` requests one after
another on a keep-alive connection, to one arm and then the other, in `--rounds` rounds (the
arms' order turning each round). Printed: the API's CPU per request (psutil, the gunicorn
master and worker) and the median time a request takes, each arm's median over the rounds, and
their ratio.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from typing import cast

import httpx
import psutil
from a2wsgi import WSGIMiddleware

from devstack import local_stack
from devstack.stack import ROOT
from thinkbatch.keys import issue_key

ARMS = ("batched", "a2wsgi")


def stock_app() -> Any:
    """The `a2wsgi` arm's ASGI app: api/asgi.py's, with a2wsgi's own middleware."""
    from api import create_app
    from api.intake import Intake
    from thinkbatch import logging_setup
    from thinkbatch.settings import get_settings

    settings = get_settings()
    logging_setup.configure(settings, "api")
    flask: Any = create_app(settings)
    return Intake(cast(Any, WSGIMiddleware(flask, workers=settings.api_threads)), settings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-bench-http-"))
    env = {"THINKBATCH_MODEL": "thinkbatch-demo", "THINKBATCH_API_WORKERS": "1"}
    with local_stack(tmp, env=env, database="bench_http", engine=False, demo_model=False) as local:
        stack = local.stack
        apis = {"batched": stack.start_api(workers=1, name="api-batched")}
        # The same gunicorn settings with the stock bridge: gunicorn's factory call syntax.
        stock = stack._spawn(  # noqa: SLF001 - the stack's own launcher, another app
            "api-a2wsgi",
            [sys.executable, "-m", "gunicorn", "-c", str(ROOT / "api" / "gunicorn.conf.py"),
             "--bind", f"127.0.0.1:{(port := _free())}", "--workers", "1",
             "bench.http_stack:stock_app()"],
        )  # fmt: skip
        stock.port = port
        _wait_serving(port)
        apis["a2wsgi"] = stock
        key = issue_key(local.database_url, "bench", "bench.http_stack")
        clients = {
            arm: httpx.Client(
                base_url=f"http://127.0.0.1:{api.port}", headers={"Authorization": f"Bearer {key}"}
            )
            for arm, api in apis.items()
        }
        items = [{"prompt": f"question {k}"} for k in range(100)]
        job = clients["batched"].post("/v1/jobs", json={"items": items}).raise_for_status().json()
        paths = {
            "/healthz": "/healthz",
            "status": f"/v1/jobs/{job['id']}",
            "items page": f"/v1/jobs/{job['id']}/items?limit=100",
        }
        results: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for arm in ARMS[r % 2 :] + ARMS[: r % 2]:
                root = psutil.Process(apis[arm].pid)
                procs = [root, *root.children(recursive=True)]
                for name, path in paths.items():
                    results.setdefault((arm, name), []).append(
                        _run(clients[arm], path, procs, args.calls)
                    )
        for client in clients.values():
            client.close()
        stack.stop_all()
    print(
        f"benchmark: {args.calls} sequential keep-alive requests per path, arm and round, "
        f"{args.rounds} rounds, arms interleaved (order turning); one gunicorn worker per arm"
    )
    print(f"{'request':12} {'arm':8} {'api cpu us':>11} {'median ms':>10}  (every round)")
    for name in paths:
        for arm in ARMS:
            rounds = results[(arm, name)]
            cpu = statistics.median(c for c, _ in rounds)
            ms = statistics.median(m for _, m in rounds)
            each = " ".join(f"{c:.0f}" for c, _ in rounds)
            print(f"{name:12} {arm:8} {cpu:11.0f} {ms:10.2f}  ({each})")
        ratio = statistics.median(c for c, _ in results[("batched", name)]) / statistics.median(
            c for c, _ in results[("a2wsgi", name)]
        )
        print(f"{name:12} batched / a2wsgi, API CPU per request: {ratio:.2f}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )


def _run(client: httpx.Client, path: str, procs: list[psutil.Process], calls: int) -> Any:
    """(API CPU us per request, median ms per request) over `calls` requests, after a warm-up."""
    for _ in range(100):
        client.get(path).raise_for_status()

    def cpu() -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in procs)

    before = cpu()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        client.get(path).raise_for_status()
        times.append(time.perf_counter() - started)
    return (cpu() - before) / calls * 1e6, statistics.median(times) * 1000


def _free() -> int:
    from devstack.services import free_port

    return free_port()


def _wait_serving(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no API on port {port}")


if __name__ == "__main__":
    main()
