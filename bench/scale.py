"""A 100,000-item job through the API (`make bench-scale`): submit time, API memory, status
latency, items pages and the rate of the streamed JSONL results.

No engine is needed: after the submit, every item is given a stored result directly in
Postgres (as a worker would), so the reads measure a finished job of full size.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from devstack import local_stack
from thinkbatch.keys import issue_key
from thinkbatch.openai import batches as batch_files


def body(n: int) -> dict[str, Any]:
    return {
        "params": {"max_tokens": 512},
        "items": [
            {
                "custom_id": f"row-{k}",
                "messages": [
                    {"role": "system", "content": "You are a careful assistant."},
                    {"role": "user", "content": f"Question {k}: summarise continuous batching."},
                ],
            }
            for k in range(n)
        ],
    }


class RssSampler(threading.Thread):
    """Peak resident memory of a process tree (the gunicorn master and its workers)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.peak = 0
        self.running = True

    def run(self) -> None:
        while self.running:
            try:
                for proc in [self.root, *self.root.children(recursive=True)]:
                    self.peak = max(self.peak, proc.memory_info().rss)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.02)


def fill_results(database_url: str, job_id: str) -> None:
    engine = sa.create_engine(database_url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE items SET status = 'running', attempts = 1, lease_owner = 'bench', "
                "started_at = now() WHERE job_id = :j"
            ),
            {"j": job_id},
        )
        conn.execute(
            sa.text(
                """
                WITH done AS (
                    UPDATE items SET status = 'succeeded', finished_at = now(),
                        lease_owner = NULL
                    WHERE job_id = :j RETURNING id, job_id
                )
                INSERT INTO item_results (item_id, job_id, attempt, thinking, answer,
                    finish_reason, thinking_truncated, prompt_tokens, completion_tokens,
                    reasoning_tokens, worker_id)
                SELECT id, job_id, 1, repeat('Let me think about this step by step. ', 8),
                       repeat('Continuous batching keeps the GPU busy. ', 4), 'stop', false,
                       40, 150, 90, 'bench'
                FROM done
                """
            ),
            {"j": job_id},
        )
        # The counts a worker's stores would have added (thinkbatch/ledger/counts.py).
        conn.execute(
            sa.text(
                "UPDATE jobs SET status = 'completed', finished_at = now(),"
                " succeeded = succeeded + unfinished, prompt_tokens = 40 * unfinished,"
                " completion_tokens = 150 * unfinished, reasoning_tokens = 90 * unfinished,"
                " unfinished = 0 WHERE id = :j"
            ),
            {"j": job_id},
        )
    engine.dispose()


def batches_listing(client: httpx.Client, database_url: str, batches: int, lines: int) -> float:
    """Median ms of listing `batches` finished batches of `lines` lines each in one page: a
    listing renders nothing (output files are made when a batch finishes), so its time does
    not grow with the batches' sizes."""
    data = b"".join(
        json.dumps(
            {"custom_id": f"l{n}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "thinkbatch-demo",
                      "messages": [{"role": "user", "content": f"Question {n}"}]}}
        ).encode() + b"\n"
        for n in range(lines)
    )  # fmt: skip
    upload = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    file_id = upload.raise_for_status().json()["id"]
    for _ in range(batches):
        made = client.post(
            "/v1/batches",
            json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                  "completion_window": "24h"},
        ).raise_for_status().json()  # fmt: skip
        fill_results(database_url, made["id"].removeprefix("batch_"))
    engine = sa.create_engine(database_url)
    made_files = batch_files.make_due_files(engine, limit=batches)
    engine.dispose()
    assert made_files == batches
    return timed(
        lambda: client.get("/v1/batches", params={"limit": batches}).raise_for_status(), 10
    )


def load_run(
    base_url: str,
    key: str,
    status_path: str,
    results_path: str,
    seconds: float,
    clients: int,
    database: str = "",
) -> dict[str, Any]:
    """`clients` threads on keep-alive connections, each request a status call (80%) or the
    results of a small finished job (20%), for `seconds`; meanwhile a submitter posts small
    jobs. Counts every answer of 500 or above, of the pollers and of the submitter alike."""
    headers = {"Authorization": f"Bearer {key}"}
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    status_ms: list[float] = []
    results_ms: list[float] = []
    server_errors: list[int] = []
    submitted = [0]

    def poller(k: int) -> None:
        # The pollers share the host's two cores with the API they measure, so they are the
        # standard library's HTTP client, which spends a fraction of httpx's CPU on a call
        # (the line "a request that does nothing" prints httpx's).
        mine_status: list[float] = []
        mine_results: list[float] = []
        errors = 0
        address = urllib.parse.urlsplit(base_url)
        conn = http.client.HTTPConnection(address.hostname or "", address.port, timeout=60)
        try:
            n = k
            while time.monotonic() < stop:
                n += 1
                is_status = n % 5 != 0  # 4 in 5: status
                started = time.perf_counter()
                conn.request("GET", status_path if is_status else results_path, headers=headers)
                response = conn.getresponse()
                response.read()
                (mine_status if is_status else mine_results).append(
                    (time.perf_counter() - started) * 1000
                )
                errors += response.status >= 500
        finally:
            conn.close()
        with lock:
            status_ms.extend(mine_status)
            results_ms.extend(mine_results)
            server_errors.append(errors)

    def submitter() -> None:
        errors = 0
        with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
            while time.monotonic() < stop:
                response = client.post("/v1/jobs", json=body(100))
                errors += response.status_code >= 500
                submitted[0] += response.status_code == 201
                time.sleep(0.5)
        with lock:
            server_errors.append(errors)

    threads = [threading.Thread(target=poller, args=(k,)) for k in range(clients)]
    threads.append(threading.Thread(target=submitter))
    cpu_before = cpu_snapshot(database)
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    cpu = cpu_used(cpu_before, database)
    ordered = sorted(status_ms)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    requests = len(status_ms) + len(results_ms)
    return {
        "rate": requests / elapsed,
        "requests": requests,
        # CPU per request by process kind: the API's workers, Postgres's backends of this
        # database, Redis, and this client itself (64 threads of http.client on one GIL).
        "cpu_us": {kind: s * 1e6 / max(1, requests) for kind, s in sorted(cpu.items())},
        "p50": pct(0.5),
        "p99": pct(0.99),
        "results_p50": statistics.median(results_ms) if results_ms else 0.0,
        "server_errors": sum(server_errors),
        "submitted": submitted[0],
        "elapsed": elapsed,
    }


def settle(database_url: str) -> None:
    """Vacuum and analyze what the runs before wrote (a 100,000-item job and its results
    twice, the batches): autovacuum would otherwise do it during the load run, on the same two
    cores, and its CPU would count as the pollers' Postgres CPU."""
    engine = sa.create_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("VACUUM ANALYZE"))
    finally:
        engine.dispose()


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT MET"


def timed(fn: Any, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--batch-lines", type=int, default=1_000)
    parser.add_argument(
        "--load-s", type=float, default=20, help="seconds of the many-pollers run (0: skip)"
    )
    parser.add_argument("--load-clients", type=int, default=64)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-scale-"))
    env = {
        "THINKBATCH_MAX_ITEMS_PER_JOB": str(max(args.items, 100_000)),
        "THINKBATCH_TENANT_JOBS_PER_MINUTE": "1000",
        "THINKBATCH_MODEL": "thinkbatch-demo",
    }
    with local_stack(tmp, env=env, database="scale", engine=False, demo_model=False) as local:
        stack, database_url = local.stack, local.database_url
        api = stack.start_api(workers=2)
        key = issue_key(database_url, "bench", "make bench-scale")
        client = httpx.Client(
            base_url=f"http://127.0.0.1:{api.port}",
            timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        )
        client.get("/healthz")  # warm both workers' imports before sampling memory
        payload = json.dumps(body(args.items)).encode()
        sampler = RssSampler(api.pid)
        baseline = max(
            p.memory_info().rss for p in [sampler.root, *sampler.root.children(recursive=True)]
        )
        sampler.start()
        started = time.perf_counter()
        job = (
            client.post("/v1/jobs", content=payload, headers={"content-type": "application/json"})
            .raise_for_status()
            .json()
        )
        submit_s = time.perf_counter() - started
        sampler.running = False
        sampler.join()
        job_id = job["id"]
        status_ms = timed(lambda: client.get(f"/v1/jobs/{job_id}").raise_for_status(), 50)
        fill_results(database_url, job_id)
        status_done_ms = timed(lambda: client.get(f"/v1/jobs/{job_id}").raise_for_status(), 50)
        # The floor under every figure above: a request the app answers at once, and what this
        # client (httpx, as a user's script would use) spends on each call itself.
        client_cpu = time.process_time()
        healthz_ms = timed(lambda: client.get("/healthz").raise_for_status(), 100)
        client_cpu_ms = (time.process_time() - client_cpu) * 1000 / 100
        first_page_ms = timed(
            lambda: client.get(f"/v1/jobs/{job_id}/items", params={"limit": 100}), 20
        )
        deep = f"row-{args.items - 200}"
        deep_page_ms = timed(
            lambda: client.get(f"/v1/jobs/{job_id}/items", params={"limit": 100, "after": deep}),
            20,
        )
        started = time.perf_counter()
        lines = size = 0
        # Read as the CLI's `results` reads it (bytes to a file), lines counted in the bytes:
        # httpx's iter_lines decodes and splits in Python, and on this host's two cores the
        # client's own line splitting took CPU from the API it measures.
        with client.stream("GET", f"/v1/jobs/{job_id}/results") as response:
            for chunk in response.iter_bytes():
                lines += chunk.count(b"\n")
                size += len(chunk)
        stream_s = time.perf_counter() - started
        listing_ms = batches_listing(client, database_url, args.batches, args.batch_lines)
        load: dict[str, Any] | None = None
        if args.load_s > 0:
            small = client.post("/v1/jobs", json=body(100)).raise_for_status().json()["id"]
            fill_results(database_url, small)
            settle(database_url)
            load = load_run(
                f"http://127.0.0.1:{api.port}",
                key,
                f"/v1/jobs/{job_id}",
                f"/v1/jobs/{small}/results",
                args.load_s,
                args.load_clients,
                database="scale",
            )
    print(f"scale: one job of {args.items} items ({len(payload) / 1e6:.1f} MB request)")
    print(
        f"submit: {submit_s:.2f} s ({args.items / submit_s:,.0f} items/s accepted) "
        f"(target: at most 1 s: {verdict(submit_s <= 1)})"
    )
    print(
        f"API memory: largest gunicorn process {baseline / 2**20:.0f} MiB idle, "
        f"{sampler.peak / 2**20:.0f} MiB peak during the submit"
    )
    print(
        f"a request that does nothing (/healthz): {healthz_ms:.1f} ms median; the client's own "
        f"CPU per call: {client_cpu_ms:.1f} ms"
    )
    print(
        f"status call: {status_ms:.1f} ms median (queued), {status_done_ms:.1f} ms (finished) "
        f"(target: at most 2 ms: {verdict(max(status_ms, status_done_ms) <= 2)})"
    )
    print(
        f"items page of 100: {first_page_ms:.1f} ms first, {deep_page_ms:.1f} ms deep (after=) "
        f"(target: at most 5 ms: {verdict(max(first_page_ms, deep_page_ms) <= 5)})"
    )
    rate = lines / stream_s
    print(
        f"results stream: {lines:,} lines, {size / 1e6:.0f} MB in {stream_s:.2f} s "
        f"({rate:,.0f} items/s, {size / 1e6 / stream_s:.0f} MB/s) "
        f"(target: at least 100,000 items/s: {verdict(rate >= 100_000)})"
    )
    print(
        f"batches list: {args.batches} finished batches of {args.batch_lines:,} lines in one "
        f"page: {listing_ms:.1f} ms median (target: at most 100 ms)"
    )
    if load is not None:
        ok = load["rate"] >= 1000 and load["p99"] <= 100 and load["server_errors"] == 0
        print(
            f"load: {args.load_clients} clients for {load['elapsed']:.0f} s, 80% status / 20% "
            f"results of a 100-item job, {load['submitted']} jobs submitted meanwhile: "
            f"{load['rate']:,.0f} requests/s, status p50 {load['p50']:.1f} ms, p99 "
            f"{load['p99']:.1f} ms, results p50 {load['results_p50']:.1f} ms, "
            f"{load['server_errors']} answers of 5xx (target: at least 1,000 requests/s, "
            f"status p99 at most 100 ms, no 5xx: {verdict(ok)})"
        )
        per = ", ".join(f"{kind} {us:,.0f}" for kind, us in load["cpu_us"].items())
        print(f"load: CPU per request (us) by process: {per}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
