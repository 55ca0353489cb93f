"""Eight workers on one job vs one worker alone: does one Postgres carry them (`make bench-fleet`)?

One API, eight workers serving the model `fleet` and one more serving `alone` (nine worker
processes, the fake engine in each). Two arms, their rounds interleaved (the order swapped every
round) so that both see the same moments of the host:

1. one worker alone: a job of `--items` / `--workers` items (one worker's share) of `alone`; the
   eight fleet workers are idle (no job of their model), as if the deployment had one GPU;
2. the fleet: one job of `--items` items of `fleet`, shared by the eight workers (a few task
   messages, then each idle worker adopts the job within a heartbeat).

Each arm's rate is its items over the time from the submit to its last stored result; the ratio
(the fleet's items/s / (workers x one worker's items/s)) is what sharing one job and one
database costs each worker, printed per round and as the median over rounds against the target
(0.9). Beside it, for each arm: how often a backend of the database waited on a lock
(`pg_stat_activity` every 5 ms, bench/pg_waits.py; target: at most 1% of the samples in which a
statement ran) and in which statements; Postgres's CPU per item (the whole embedded cluster:
its postmaster, every backend and background process, the exited ones included, less the
sampler's own backend) and the items/s one Postgres core carries at that cost; the host's CPU
by process kind (psutil), to show the host was not the bound; and that every item of every job
has exactly one result row (0 lost, 0 duplicated).

Every worker runs the fake engine at a GPU's step time: `step_s` 0.04 with up to 256 sequences
and 32 output tokens per item (ignore_eos), a decode step of an 8B model at a batch of 256 on
one GPU, so at most 256 / (0.04 x 32) = 200 items/s a worker and 1,600 for eight. The workers
are then engine-bound, as on GPU hosts, and the question is whether Postgres keeps up with eight
of them. At `step_s` 0 (tokens at no cost) eight workers would instead compete for this host's
two cores (the whole pipeline costs about 260 us of CPU per item here: 1,600 items/s is about
0.4 of a core, 8 x the ceiling would be several cores), and the ratio would measure that
contention, not Postgres. Short outputs (32 tokens) make many items per second per GPU: the
hardest case for the database; real jobs with longer answers load it less.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from datetime import UTC
from datetime import datetime
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psutil
import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.cpu import worker_cpu
from bench.pg_waits import INTERVAL_S
from bench.pg_waits import PgWaits
from bench.pg_waits import Waits
from bench.workload import prompts
from devstack import local_stack
from devstack.audit import lost_and_duplicated
from devstack.services import LocalPostgres
from devstack.services import free_port
from devstack.stack import Proc
from thinkbatch.keys import issue_key

FLEET, ALONE = "fleet", "alone"
TARGET_RATIO = 0.9
TARGET_LOCK_SHARE = 0.01  # of the samples in which a statement ran
STEP_S = 0.04
MAX_NUM_SEQS = 256
TOKENS = 32


def engine_env() -> dict[str, str]:
    return {
        "THINKBATCH_ENGINE": "fake",
        "THINKBATCH_ENGINE_EXTRA_ARGS": json.dumps({"step_s": STEP_S}),
        "THINKBATCH_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "THINKBATCH_SERVED_MODELS": json.dumps([FLEET, ALONE]),
    }


# --- pure figures (tests/unit/test_bench_fleet.py) -------------------------------------------


def fleet_ratio(fleet_rate: float, alone_rate: float, workers: int) -> float:
    """The fleet's items/s over `workers` times one worker's alone: 1.0 scales perfectly."""
    return fleet_rate / (workers * alone_rate) if alone_rate > 0 else 0.0


def verdict(value: float, target: float, *, at_most: bool = False) -> str:
    met = value <= target if at_most else value >= target
    return "met" if met else "NOT met"


def lock_figures(lock_samples: int, samples: int, items: int) -> tuple[float, float]:
    """(share of the samples with a statement running in which a backend waited on a lock,
    such samples per 1,000 items)."""
    share = lock_samples / samples if samples else 0.0
    return share, (1000 * lock_samples / items if items else 0.0)


def spread(values: Sequence[float], fmt: str = "{:.1f}") -> str:
    """ "lo-hi" of some values, or the one value."""
    lo, hi = min(values), max(values)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


# --- measuring ---------------------------------------------------------------------------------


def cluster_cpu(pg: LocalPostgres) -> dict[int, float]:
    """CPU seconds of the embedded Postgres so far, by pid: the postmaster with its exited
    children's time (reaped backends), and every live child (backends, WAL writer,
    checkpointer, autovacuum). Summed, the difference of two of these is the cluster's CPU."""
    pid = int((pg.data_dir / "postmaster.pid").read_text().split()[0])
    postmaster = psutil.Process(pid)
    t = postmaster.cpu_times()
    out = {pid: t.user + t.system + t.children_user + t.children_system}
    for child in postmaster.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        out[child.pid] = c.user + c.system
    return out


@dataclass
class Arm:
    items: int
    seconds: float  # submit to the last stored result
    submit_s: float  # the POST's own time
    waits: Waits
    pg_cpu_s: float
    cpu: dict[str, float]  # CPU seconds by process kind (psutil), postgres from the cluster
    workers: list[tuple[str, int, float, float]]  # id, items, first and last result (s)
    all_storing_rate: float  # items/s from the moment the last worker stored its first result
    lost: int
    duplicated: int
    steps: float = 0.0  # engine steps of the arm's workers and the requests they ran
    step_requests: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.items / self.seconds

    @property
    def mean_batch(self) -> float:
        return self.step_requests / self.steps if self.steps else 0.0


def engine_counts(ports: list[int]) -> tuple[float, float]:
    steps = requests = 0.0
    for port in ports:
        m = worker_cpu(port)
        steps += m.get("engine steps", 0.0)
        requests += m.get("engine step requests", 0.0)
    return steps, requests


def run_arm(
    client: httpx.Client,
    db: sa.Engine,
    database_url: str,
    pg: LocalPostgres,
    model: str,
    items: list[dict[str, Any]],
    ports: list[int],
) -> Arm:
    """One job of `model`, submit to completed, with Postgres sampled and the CPU counted."""
    body = {
        "model": model,
        "items": items,
        "params": {"ignore_eos": True, "max_tokens": TOKENS, "temperature": 0},
    }
    steps0, requests0 = engine_counts(ports)
    database = database_url.rsplit("/", 1)[1]
    sampler = PgWaits(database_url)
    with sampler as waits:
        cpu0 = cpu_snapshot(database)
        pg0 = cluster_cpu(pg)
        submitted = datetime.now(UTC)
        started = time.monotonic()
        job = client.post("/v1/jobs", json=body).raise_for_status().json()
        submit_s = time.monotonic() - started
        while job["status"] in ("queued", "running"):
            time.sleep(0.5)
            job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
        # Before the sampler stops: its backend is still there to be left out.
        pg1 = cluster_cpu(pg)
        cpu = cpu_used(cpu0, database)
    steps1, requests1 = engine_counts(ports)
    if job["status"] != "completed" or job["counts"]["succeeded"] != len(items):
        raise RuntimeError(f"the benchmark job did not complete: {job}")
    own = sampler.backend_pid
    pg_cpu = sum(pg1.values()) - sum(pg0.values())
    if own is not None:
        pg_cpu -= pg1.get(own, 0.0) - pg0.get(own, 0.0)
    cpu["postgres"] = pg_cpu  # psutil saw only the backends; the cluster's whole CPU instead
    cpu.pop("other", None)  # this process: the client, its polls and the sampler

    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT worker_id, count(*), min(created_at), max(created_at)"
                " FROM item_results WHERE job_id = :id GROUP BY 1 ORDER BY 3"
            ),
            {"id": job["id"]},
        ).all()
        workers = [
            (str(w), int(n), (a - submitted).total_seconds(), (b - submitted).total_seconds())
            for w, n, a, b in rows
        ]
        last_join = max(first for _, _, first, _ in workers)
        end = max(last for _, _, _, last in workers)
        stored_after = conn.execute(
            sa.text("SELECT count(*) FROM item_results WHERE job_id = :id AND created_at > :t"),
            {"id": job["id"], "t": submitted + timedelta(seconds=last_join)},
        ).scalar_one()
    lost, duplicated = lost_and_duplicated(db, job["id"])
    return Arm(
        items=len(items),
        seconds=end,
        submit_s=submit_s,
        waits=waits,
        pg_cpu_s=pg_cpu,
        cpu=cpu,
        workers=workers,
        all_storing_rate=stored_after / (end - last_join) if end > last_join else 0.0,
        lost=lost,
        duplicated=duplicated,
        steps=steps1 - steps0,
        step_requests=requests1 - requests0,
    )


def worker_footprint(procs: list[Proc]) -> str:
    """Threads and resident memory of the worker processes (with any children)."""
    threads, rss = [], []
    for proc in procs:
        p = psutil.Process(proc.pid)
        family = [p, *p.children(recursive=True)]
        threads.append(sum(q.num_threads() for q in family))
        rss.append(sum(q.memory_info().rss for q in family) / 2**20)
    return (
        f"{len(procs)} worker processes (Celery threads pool): {spread(threads, '{:.0f}')} "
        f"threads and {spread(rss, '{:.0f}')} MiB resident each, {sum(rss) / 1024:.2f} GiB in all"
    )


def print_round(r: int, alone: Arm, fleet: Arm, workers: int) -> None:
    ratio = fleet_ratio(fleet.rate, alone.rate, workers)
    print(
        f"round {r}: alone {alone.items:,} items in {alone.seconds:.1f} s: "
        f"{alone.rate:,.1f} items/s; {workers} workers {fleet.items:,} in {fleet.seconds:.1f} s: "
        f"{fleet.rate:,.1f} items/s; ratio {ratio:.3f}",
        flush=True,
    )
    for name, arm in (("alone", alone), (f"{workers} workers", fleet)):
        share, per_k = lock_figures(arm.waits.lock_samples, arm.waits.samples, arm.items)
        firsts = [first for _, _, first, _ in arm.workers]
        lasts = [last for _, _, _, last in arm.workers]
        counts = [n for _, n, _, _ in arm.workers]
        print(
            f"  {name}: submit {arm.submit_s:.2f} s; {len(arm.workers)} worker(s) stored, "
            f"first result {spread(firsts, '{:.1f}')} s after the submit, last "
            f"{spread(lasts, '{:.1f}')} s, items each {spread(counts, '{:,.0f}')}; "
            f"{arm.all_storing_rate:,.1f} items/s once all stored; mean engine batch "
            f"{arm.mean_batch:.0f} of {MAX_NUM_SEQS}; lock waits in {100 * share:.2f}% of "
            f"{arm.waits.samples} samples ({per_k:.2f} per 1,000 items); postgres "
            f"{1e6 * arm.pg_cpu_s / arm.items:.0f} us CPU per item; lost {arm.lost}, "
            f"duplicated {arm.duplicated}",
            flush=True,
        )


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def summary(alone: list[Arm], fleet: list[Arm], workers: int) -> None:
    ratios = [fleet_ratio(f.rate, a.rate, workers) for a, f in zip(alone, fleet, strict=True)]
    ratio = median(ratios)
    n_alone, n_fleet = alone[0].items, fleet[0].items
    print(f"-- {workers} workers on one job of {n_fleet:,} items vs one worker on {n_alone:,} --")
    print(
        f"throughput (submit to the last stored result), median of {len(ratios)} round(s): "
        f"{workers} workers {median([f.rate for f in fleet]):,.1f} items/s, one worker alone "
        f"{median([a.rate for a in alone]):,.1f} items/s (x {workers} = "
        f"{workers * median([a.rate for a in alone]):,.1f})"
    )
    print(
        f"ratio {workers} workers / ({workers} x one worker): {ratio:.3f} (target >= "
        f"{TARGET_RATIO:.2f}: {verdict(ratio, TARGET_RATIO)}); round by round: "
        + " ".join(f"{x:.3f}" for x in ratios)
    )
    steady = median(
        [
            fleet_ratio(f.all_storing_rate, a.all_storing_rate, workers)
            for a, f in zip(alone, fleet, strict=True)
        ]
    )
    print(
        f"  once every worker stored results: {workers} workers "
        f"{median([f.all_storing_rate for f in fleet]):,.1f} items/s, one worker alone "
        f"{median([a.all_storing_rate for a in alone]):,.1f} (from its first result), "
        f"ratio {steady:.3f}; "
        f"the last worker's first result "
        f"{median([max(w[2] for w in f.workers) for f in fleet]):.1f} s after the submit; "
        f"the submit itself {median([f.submit_s for f in fleet]):.2f} s "
        f"(alone {median([a.submit_s for a in alone]):.2f} s)"
    )
    every = f"{INTERVAL_S * 1000:.0f} ms"
    for name, arms in ((f"{workers} workers", fleet), ("one worker alone", alone)):
        samples = sum(a.waits.samples for a in arms)
        locked = sum(a.waits.lock_samples for a in arms)
        items = sum(a.items for a in arms)
        share, per_k = lock_figures(locked, samples, items)
        print(
            f"lock waits, {name}: a backend waited on a lock in {100 * share:.2f}% of {samples:,} "
            f"samples (pg_stat_activity every {every}, those with a statement running), "
            f"{per_k:.2f} such samples per 1,000 items (target <= {100 * TARGET_LOCK_SHARE:.0f}% "
            f"of samples: {verdict(share, TARGET_LOCK_SHARE, at_most=True)})"
        )
    waits: Any = sum((a.waits.lock_waits for a in fleet), start=type(fleet[0].waits.lock_waits)())
    total = sum(waits.values())
    for (event, query), count in waits.most_common(5):
        print(f"  {100 * count / total:.0f}% of the waiting backends ({event}): {query}")
    for name, arms in ((f"{workers} workers", fleet), ("one worker alone", alone)):
        cpu_s = sum(a.pg_cpu_s for a in arms)
        items = sum(a.items for a in arms)
        wall = sum(a.seconds for a in arms)
        print(
            f"postgres CPU, {name}: {1e6 * cpu_s / items:.0f} us per item, "
            f"{items / cpu_s:,.0f} items/s per postgres core; {cpu_s / wall:.2f} cores busy"
        )
    for name, arms in ((f"{workers} workers", fleet), ("one worker alone", alone)):
        wall = sum(a.seconds for a in arms)
        kinds = ("worker", "api", "postgres", "redis")
        used = {k: sum(a.cpu.get(k, 0.0) for a in arms) / wall for k in kinds}
        print(
            f"host CPU, {name} (cores busy, submit to last result): "
            + ", ".join(f"{k} {v:.2f}" for k, v in used.items())
            + f"; {sum(used.values()):.2f} in all"
        )
    lost = sum(a.lost for a in alone + fleet)
    duplicated = sum(a.duplicated for a in alone + fleet)
    print(
        f"lost {lost}, duplicated {duplicated} over {len(alone + fleet)} jobs "
        f"(target 0 and 0: {'met' if lost == duplicated == 0 else 'NOT met'})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=50_000, help="items of the fleet's job")
    parser.add_argument("--workers", type=int, default=8, help="workers sharing that job")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each arm")
    args = parser.parse_args()
    n, k = args.items, args.workers
    share = n // k
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-bench-fleet-"))
    per_worker = MAX_NUM_SEQS / (STEP_S * TOKENS)
    print(
        f"benchmark: {k} workers on one job of {n:,} items vs one worker alone on {share:,}, "
        f"x {TOKENS} output tokens (ignore_eos), {args.rounds} round(s) per arm, interleaved; "
        f"fake engine, step_s {STEP_S}, max_num_seqs {MAX_NUM_SEQS} (engine-bound: at most "
        f"{per_worker:.0f} items/s a worker, {k * per_worker:,.0f} for {k})",
        flush=True,
    )
    alone: list[Arm] = []
    fleet: list[Arm] = []
    started = time.monotonic()
    with local_stack(tmp, database="bench_fleet", engine=False, demo_model=False) as local:
        stack = local.stack
        stack.env.update(engine_env())
        pg = next(s for s in local.services if isinstance(s, LocalPostgres))
        api = stack.start_api(workers=2)
        procs, ports = [], []
        for i in range(k + 1):
            name = f"{FLEET}{i}" if i < k else ALONE
            ports.append(free_port())
            procs.append(
                stack.start_worker(
                    name,
                    env={
                        "THINKBATCH_SERVED_MODEL_NAME": FLEET if i < k else ALONE,
                        "THINKBATCH_WORKER_METRICS_PORT": str(ports[-1]),
                    },
                    wait=False,
                )
            )
        for proc in procs:
            stack.wait_worker_ready(proc)
        print(worker_footprint(procs), flush=True)
        key = issue_key(local.database_url, "bench", "make bench-fleet")
        db = sa.create_engine(local.database_url)
        with httpx.Client(
            base_url=f"http://127.0.0.1:{api.port}",
            timeout=600,
            headers={"Authorization": f"Bearer {key}"},
        ) as client:
            # Warm every path up: the fleet's workers all take a share of a small job.
            run_arm(client, db, local.database_url, pg, ALONE, prompts(256, 998), ports[k:])
            run_arm(client, db, local.database_url, pg, FLEET, prompts(4096, 999), ports[:k])
            for r in range(args.rounds):
                arms = [(ALONE, share, ports[k:]), (FLEET, n, ports[:k])]
                got = {}
                for model, size, its in arms if r % 2 == 0 else arms[::-1]:
                    got[model] = run_arm(
                        client,
                        db,
                        local.database_url,
                        pg,
                        model,
                        prompts(size, 2 * r + (model == FLEET)),
                        its,
                    )
                    time.sleep(1)
                alone.append(got[ALONE])
                fleet.append(got[FLEET])
                print_round(r + 1, got[ALONE], got[FLEET], k)
        db.dispose()
    summary(alone, fleet, k)
    print(f"run time {time.monotonic() - started:.0f} s (starting the stack included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
