"""Raw engine vs the job system, side by side in one run (`make bench`).

Both arms use the same model, engine settings (from the environment, as the worker reads them),
prompts and sampling (`ignore_eos`, fixed `max_tokens`, greedy):

1. raw engine: the worker's own vLLM adapter, every prompt pre-tokenized and submitted at once;
2. job system: POST /v1/jobs -> Postgres -> Redis -> Celery worker -> vLLM -> Postgres, timed
   from the submit until the job is `completed`.

It prints items/s and output tokens/s of both, their ratio (system / raw), the overhead per item,
the time to the first stored result and the rate of result rows written to Postgres. The same
script runs on a GPU host with a real model: only the settings change.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from thinkbatch.settings import DEMO_MODEL
from thinkbatch.settings import Settings
from thinkbatch.stack import ROOT
from thinkbatch.stack import Stack
from thinkbatch.stack import engine_env

# On this CPU: a full vLLM batch (256 sequences) and room for it in the KV cache.
CPU_BENCH = {"MAX_NUM_SEQS": "256", "CPU_KVCACHE_SPACE_GIB": "2", "MAX_MODEL_LEN": "512"}


def prompts(n: int) -> list[dict[str, Any]]:
    topics = [
        "continuous batching", "PagedAttention", "the KV cache", "left padding",
        "speculative decoding", "prefix caching", "tensor parallelism", "quantization",
    ]  # fmt: skip
    return [
        {
            "custom_id": f"b{k}",
            "messages": [
                {"role": "user", "content": f"Question {k}: explain {topics[k % len(topics)]}."}
            ],
        }
        for k in range(n)
    ]


def run_raw(n: int, max_tokens: int) -> dict[str, float]:
    """The raw arm, in this (child) process: the adapter, all prompts at once."""
    import asyncio
    import uuid

    from thinkbatch.ledger import Claimed
    from thinkbatch.sampling import resolve_sampling
    from worker.vllm_engine import VLLMEngine

    settings = Settings()
    engine = VLLMEngine(settings)
    params = {"ignore_eos": True, "max_tokens": max_tokens, "temperature": 0}

    async def main() -> dict[str, float]:
        await engine.start()
        items = [
            Claimed(k, uuid.uuid4(), k, p["custom_id"], p["messages"], None, None, 1, 0)
            for k, p in enumerate(prompts(n))
        ]
        sampling = [resolve_sampling(params, None, default_max_tokens=max_tokens)] * n
        prepared = engine.prepare(items, sampling)
        started = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate(f"raw-{k}", p) for k, p in enumerate(prepared))  # type: ignore[arg-type]
        )
        elapsed = time.perf_counter() - started
        await engine.shutdown()
        return {"seconds": elapsed, "output_tokens": sum(len(o.token_ids) for o in outs)}

    return asyncio.run(main())


def run_system(
    stack: Stack, database_url: str, n: int, max_tokens: int, profile: Path | None
) -> dict[str, float]:
    api = stack.start_api(workers=2)
    worker = stack.start_worker("worker")
    spy = None
    if profile is not None:  # sample the worker's Python stacks while the job runs
        spy = subprocess.Popen(
            [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(worker.pid),
             "--rate", "50", "--gil", "--nonblocking", "--format", "raw", "--output", str(profile)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        time.sleep(1)
    client = httpx.Client(base_url=f"http://127.0.0.1:{api.port}", timeout=300)
    body = {
        "items": prompts(n),
        "params": {"ignore_eos": True, "max_tokens": max_tokens, "temperature": 0},
    }
    submitted = datetime.now(UTC)
    started = time.perf_counter()
    job = client.post("/v1/jobs", json=body).raise_for_status().json()
    submit_s = time.perf_counter() - started
    while job["status"] in ("queued", "running"):
        time.sleep(0.1)
        job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait(30)
    if job["status"] != "completed" or job["counts"]["succeeded"] != n:
        raise RuntimeError(f"the benchmark job did not complete: {job}")
    engine = sa.create_engine(database_url)
    with engine.connect() as conn:
        first, last = conn.execute(
            sa.text("SELECT min(created_at), max(created_at) FROM item_results WHERE job_id = :j"),
            {"j": job["id"]},
        ).one()
    engine.dispose()
    finished = datetime.fromisoformat(job["finished_at"])
    return {
        "seconds": (finished - submitted).total_seconds(),
        "submit_seconds": submit_s,
        "first_result_seconds": (first - submitted).total_seconds(),
        "rows_per_second": n / max((last - first).total_seconds(), 1e-9),
        "output_tokens": job["usage"]["completion_tokens"],
    }


def write_capacity(database_url: str, n: int = 6000, batch: int = 500) -> float:
    """Rows/s the worker's result statement (ledger.complete) stores, apart from the engine."""
    from sqlalchemy import orm

    from thinkbatch import jobs as service
    from thinkbatch import ledger
    from thinkbatch.schemas import JobCreate

    settings = Settings(database_url=database_url)
    engine = sa.create_engine(database_url)
    spec = JobCreate.model_validate({"items": [{"prompt": f"p{k}"} for k in range(n)]})
    with orm.Session(engine) as session, session.begin():
        job_id = service.create_job(session, spec, settings).id
        session.execute(
            sa.text("INSERT INTO workers (id, hostname, pid, model) VALUES ('bench', 'h', 0, 'm')")
        )
    with engine.begin() as conn:
        claimed = ledger.claim(conn, job_id, owner="bench", n=n, lease_s=600)
    text = "Continuous batching keeps the engine busy. " * 6
    done = [ledger.Done(c.id, job_id, c.attempt, text, text, "length", False, 20, 64, 30)
            for c in claimed]  # fmt: skip
    started = time.perf_counter()
    for k in range(0, n, batch):
        with engine.begin() as conn:
            ledger.complete(conn, "bench", done[k : k + batch])
    elapsed = time.perf_counter() - started
    engine.dispose()
    return n / elapsed


def top_frames(folded: Path, limit: int = 12) -> list[tuple[float, str]]:
    """Share of the worker's samples by innermost frame, from py-spy's raw output."""
    counts: dict[str, int] = {}
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        leaf = stack.rsplit(";", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + int(n)
        total += int(n)
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:limit]
    return [(100 * c / max(total, 1), frame) for frame, c in ranked]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--profile", action="store_true", help="py-spy the worker (needs py-spy)")
    parser.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_only:  # child process of the raw arm
        print(json.dumps(run_raw(args.items, args.max_tokens)))
        return 0

    env = engine_env(CPU_BENCH)
    settings = Settings(**{k.lower(): v for k, v in env.items()})  # type: ignore[arg-type]
    services: list[Any] = []
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-bench-"))
    if not settings.database_url or not settings.redis_url:
        from thinkbatch.local_services import LocalPostgres
        from thinkbatch.local_services import LocalRedis

        pg = LocalPostgres(tmp / "pg", fast=False).start()
        redis_server = LocalRedis(tmp / "redis").start()
        services += [pg, redis_server]
        env["DATABASE_URL"] = pg.create_database("bench")
        env["REDIS_URL"] = redis_server.url(0)
    database_url = env.get("DATABASE_URL") or settings.require_database_url()
    child_env = {**os.environ, **env}
    subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], env=child_env,
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL)  # fmt: skip
    if settings.model == DEMO_MODEL:
        subprocess.run([sys.executable, "-m", "demo.model"], env=child_env, check=True)

    print(f"benchmark: {args.items} items x {args.max_tokens} output tokens (ignore_eos), "
          f"model {settings.model}", flush=True)  # fmt: skip
    print("engine: " + ", ".join(
        f"{k}={getattr(settings, k)}" for k in
        ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "enforce_eager",
         "enable_prefix_caching", "dtype", "tensor_parallel_size")
    ), flush=True)  # fmt: skip
    raw_out = subprocess.run(
        [sys.executable, "-m", "bench.throughput", "--raw-only",
         "--items", str(args.items), "--max-tokens", str(args.max_tokens)],
        env=child_env, cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    raw = json.loads(raw_out.stdout.strip().splitlines()[-1])
    stack = Stack(env, tmp / "logs")
    try:
        profile = tmp / "worker.folded" if args.profile else None
        system = run_system(stack, database_url, args.items, args.max_tokens, profile)
        capacity = write_capacity(database_url)
    finally:
        stack.stop_all()
        for service in reversed(services):
            service.stop()

    n = args.items
    rows = [
        ("raw engine", n / raw["seconds"], raw["output_tokens"] / raw["seconds"], raw["seconds"]),
        ("job system", n / system["seconds"], system["output_tokens"] / system["seconds"],
         system["seconds"]),
    ]  # fmt: skip
    print(f"{'arm':12} {'items/s':>9} {'out tok/s':>10} {'seconds':>8}")
    for name, ips, tps, secs in rows:
        print(f"{name:12} {ips:9.1f} {tps:10.0f} {secs:8.2f}")
    ratio = rows[1][1] / rows[0][1]
    print(f"ratio (system / raw): {ratio:.3f}")
    print(f"overhead per item: {(system['seconds'] - raw['seconds']) / n * 1000:.2f} ms")
    print(f"submit ({n} items over HTTP): {system['submit_seconds']:.2f} s")
    print(f"time to first stored result: {system['first_result_seconds']:.2f} s")
    print(
        f"result rows written to Postgres: {system['rows_per_second']:.0f} rows/s in this run "
        f"(engine-bound); the writer's statement alone: {capacity:,.0f} rows/s"
    )
    if profile is not None and profile.exists():
        print("worker profile (py-spy, share of samples by innermost frame):")
        for share, frame in top_frames(profile):
            print(f"  {share:5.1f}%  {frame}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
