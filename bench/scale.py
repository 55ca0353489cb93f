"""A 100,000-item job through the API (`make bench-scale`): submit time, API memory, status
latency, items pages and the rate of the streamed JSONL results.

No engine is needed: after the submit, every item is given a stored result directly in
Postgres (as a worker would), so the reads measure a finished job of full size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa

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
        conn.execute(
            sa.text("UPDATE jobs SET status = 'completed', finished_at = now() WHERE id = :j"),
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
        with client.stream("GET", f"/v1/jobs/{job_id}/results") as response:
            for line in response.iter_lines():
                lines += 1
                size += len(line) + 1
        stream_s = time.perf_counter() - started
        listing_ms = batches_listing(client, database_url, args.batches, args.batch_lines)
    print(f"scale: one job of {args.items} items ({len(payload) / 1e6:.1f} MB request)")
    print(f"submit: {submit_s:.2f} s ({args.items / submit_s:,.0f} items/s accepted)")
    print(
        f"API memory: largest gunicorn process {baseline / 2**20:.0f} MiB idle, "
        f"{sampler.peak / 2**20:.0f} MiB peak during the submit"
    )
    print(f"status call: {status_ms:.1f} ms median (queued), {status_done_ms:.1f} ms (finished)")
    print(f"items page of 100: {first_page_ms:.1f} ms first, {deep_page_ms:.1f} ms deep (after=)")
    print(
        f"results stream: {lines:,} lines, {size / 1e6:.0f} MB in {stream_s:.2f} s "
        f"({lines / stream_s:,.0f} items/s, {size / 1e6 / stream_s:.0f} MB/s)"
    )
    print(
        f"batches list: {args.batches} finished batches of {args.batch_lines:,} lines in one "
        f"page: {listing_ms:.1f} ms median (target: at most 100 ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
