"""Where `make bench`'s CPU goes: by process kind (psutil, only this benchmark's processes) and,
inside the worker, by stage and thread (the worker's own thread CPU clocks, on its /metrics)."""

from __future__ import annotations

import time
from typing import Any

import httpx


def _category(proc: Any) -> str:
    text = " ".join(proc.info["cmdline"] or [proc.info["name"] or ""])
    for needle, category in (
        ("EngineCore", "engine"), ("VLLM::Worker", "engine"), ("celery", "worker"),
        ("gunicorn", "api"), ("postgres", "postgres"), ("redis-server", "redis"),
        ("bench.raw_arm", "raw client"), ("bench.throughput", "bench"), ("bench.scale", "bench"),
    ):  # fmt: skip
        if needle in text or needle in (proc.info["name"] or ""):
            return category
    return "other"


def _ours(proc: Any, descendants: set[int], database: str) -> bool:
    """A process of this benchmark: one it started (API, workers, engines, its own Postgres and
    Redis), or a backend of a shared Postgres serving its database. The host may be shared:
    other people's processes are left out, and so are a shared Postgres's background
    processes and a shared Redis, which serve everybody."""
    if proc.pid in descendants:
        return True
    text = " ".join(proc.info["cmdline"] or [])
    return text.startswith("postgres:") and f" {database} " in text


def cpu_snapshot(database: str = "") -> dict[int, tuple[str, float]]:
    """CPU seconds used so far by every process of this benchmark, with a category each;
    `database`: the benchmark's, whose backends on a shared Postgres count as its own."""
    import psutil

    me = psutil.Process()
    descendants = {me.pid} | {p.pid for p in me.children(recursive=True)}
    snapshot = {}
    for proc in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        times = proc.info["cpu_times"]
        if times is not None and _ours(proc, descendants, database):
            category = _category(proc)
            snapshot[proc.pid] = (category, times.user + times.system)
            if category == "postgres" and not " ".join(proc.info["cmdline"] or []).startswith(
                "postgres:"
            ):
                # The embedded postmaster: its reaped children's time, under a key of its own,
                # so that a backend that came and went between two snapshots (a connection of
                # its own, as the ANALYZE after a large submit takes) is counted too.
                snapshot[-proc.pid] = (REAPED, times.children_user + times.children_system)
    return snapshot


REAPED = "postgres (exited backends)"


def cpu_used(before: dict[int, tuple[str, float]], database: str = "") -> dict[str, float]:
    now = cpu_snapshot(database)
    used: dict[str, float] = {}
    for pid, (category, seconds) in now.items():
        spent = seconds - before.get(pid, (category, 0.0))[1]
        category = "postgres" if category == REAPED else category
        used[category] = used.get(category, 0.0) + spent
    if any(category == REAPED for category, _ in now.values()):
        # A backend alive at `before` and reaped since: all its time is in the reaped sum now,
        # of which what it had used by `before` was not spent in between.
        for pid, (category, seconds) in before.items():
            if category == "postgres" and pid not in now:
                used["postgres"] -= seconds
    return used


def wait_engines_idle(timeout: float = 10.0, window: float = 0.2, busy: float = 0.05) -> float:
    """Wait until this benchmark's engine processes use less than `busy` of a core over
    `window` seconds; return the seconds waited. An engine that has just finished keeps its
    model process spinning on its core for a second (vLLM's shared-memory queue polls
    `busy_loop_s` = 1 s after its last read, with sched_yield): started at once, the next
    round shared that core with it. The system arm always followed a raw round that had just
    ended, and its engine's core lost 0.7-0.8 CPU-s per 2,000 x 16 round to the idle raw
    engine; a raw round followed a system round that ended up to a poll interval earlier."""
    started = time.monotonic()

    def engine_cpu() -> float:
        return sum(s for kind, s in cpu_snapshot().values() if kind == "engine")

    while time.monotonic() - started < timeout:
        before = engine_cpu()
        time.sleep(window)
        if engine_cpu() - before < busy * window:
            break
    return time.monotonic() - started


_FAMILIES = {
    "thinkbatch_worker_stage_cpu_seconds": "stage",
    "thinkbatch_worker_thread_cpu_seconds": "thread",
    "thinkbatch_worker_process_cpu_seconds": "process",
    # Not CPU: the engine's steps and the requests each ran, summed (the mean batch).
    "thinkbatch_worker_engine_steps": "engine steps",
    "thinkbatch_worker_engine_step_requests": "engine step requests",
    # Not CPU: the prompt tokens its prefix cache was asked for and held (the hit rate).
    "thinkbatch_worker_engine_prefix_cache_queries": "prefix cache queries",
    "thinkbatch_worker_engine_prefix_cache_hits": "prefix cache hits",
}


def worker_cpu(port: int) -> dict[str, float]:
    """The worker's CPU seconds so far by stage, by thread and in all, and its engine's steps
    and the requests each ran, summed (its /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        kind = _FAMILIES.get(family.name)
        if kind is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                label = sample.labels.get(kind, "")
                out[f"{kind}:{label}" if label else kind] = sample.value
    return out


STAGE_ORDER = ("claim", "prepare", "launch", "submit", "output", "settle", "parse", "store")
RUNNER_THREADS = ("claimer", "engine-loop", "writer", "housekeeper")


def stage_rows(system: dict[str, Any], n: int) -> list[tuple[str, float]]:
    """Microseconds of CPU per item: the worker's stages, its threads and the process kinds."""
    cpu: dict[str, float] = system["stages"]
    per = 1e6 / n
    rows = [(f"  {s}", cpu.get(f"stage:{s}", 0.0) * per) for s in STAGE_ORDER]
    loop_stages = sum(cpu.get(f"stage:{s}", 0.0) for s in ("submit", "output", "settle"))
    rows.append((
        "  engine loop, rest (engine's output handler / fake engine steps, asyncio)",
        (cpu.get("thread:engine-loop", 0.0) - loop_stages) * per,
    ))  # fmt: skip
    threads = {k[len("thread:") :]: v for k, v in cpu.items() if k.startswith("thread:")}
    for name in RUNNER_THREADS:
        rows.append((f"  thread {name}", threads.get(name, 0.0) * per))
    others = sum(v for k, v in threads.items() if k not in RUNNER_THREADS)
    rows.append(("  other Python threads (Celery task threads, metrics...)", others * per))
    rows.append((
        "  threads Python did not start (engine client's, torch's)",
        (cpu.get("process", 0.0) - sum(threads.values())) * per,
    ))  # fmt: skip
    rows.append(("  worker process (its /metrics)", cpu.get("process", 0.0) * per))
    by_kind: dict[str, float] = system["cpu"]
    for kind in ("worker", "engine", "api", "postgres", "redis"):
        rows.append((f"{kind} processes (psutil)", by_kind.get(kind, 0.0) * per))
    return rows


# The processes a job's work runs in (the benchmark's own client and the raw arm's are not).
PIPELINE_KINDS = ("worker", "engine", "api", "postgres", "redis")


def pipeline_bound(system: dict[str, Any], n: int, cores: int) -> tuple[float, float]:
    """CPU per item (us) summed over the pipeline's processes in a round of `n` items, and the
    most items/s `cores` could give it at that cost if every core were busy all the time."""
    by_kind: dict[str, float] = system["cpu"]
    per_item = sum(by_kind.get(kind, 0.0) for kind in PIPELINE_KINDS) * 1e6 / n
    return per_item, (cores * 1e6 / per_item if per_item > 0 else float("inf"))


def print_stages(columns: list[tuple[str, dict[str, Any], int]]) -> None:
    print(
        "CPU per item (us), median round of each part; the worker's stages and threads from "
        "its thread CPU clocks (/metrics), the processes from psutil:"
    )
    tables = [stage_rows(system, n) for _, system, n in columns]
    width = max(len(label) for label, _ in tables[0])
    print(f"{'':{width}} " + " ".join(f"{name:>10}" for name, _, _ in columns))
    for i, (label, _) in enumerate(tables[0]):
        print(f"{label:{width}} " + " ".join(f"{t[i][1]:10.1f}" for t in tables))
