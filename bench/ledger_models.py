"""Claims of a mixed job against a job of one model, the ledger alone (`python -m
bench.ledger_models`): a job of the base model and five adapters (a sixth of the items each)
is claimed 512 items at a time by a worker serving two adapters, and by one serving the base
model and one adapter; the baseline, in the same run, is a job of one model as large as
what each of them takes, claimed the same way. Each prints Postgres's CPU per item claimed
and its ratio to the baseline's. Then, with those workers' items all claimed and the rest of
the job pending, how long a worker of the finished models takes to ask whether anything is
left for it (the probes of thinkbatch/ledger/claims.py and hints.py).

It runs on the embedded PostgreSQL, on this host's CPU; docs/performance.md shows its output.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from devstack import local_stack
from thinkbatch import ledger
from thinkbatch.jobs import JobService
from thinkbatch.keys import Caller
from thinkbatch.ledger import ModelFilter
from thinkbatch.settings import Settings

BASE = "base"
ADAPTERS = ["a1", "a2", "a3", "a4", "a5"]
CLAIM_N = 512  # the worker's claim chunk at rest
WORKERS = {"two adapters": ["a1", "a2"], "base and one adapter": [BASE, "a1"]}


def submit(db: sa.Engine, settings: Settings, n: int, mixed: bool) -> Any:
    names: list[str | None] = [*ADAPTERS, None] if mixed else [None]
    items = [
        {
            "prompt": f"question {k} about the text",
            **({"model": names[k % len(names)]} if names[k % len(names)] else {}),
        }
        for k in range(n)
    ]
    raw = io.BytesIO(json.dumps({"model": BASE, "items": items}).encode())
    job = JobService(settings, db, celery=None).submit_stream(Caller("bench", None), raw).job
    with db.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT").execute(sa.text("ANALYZE items"))
    return job


def claim_all(db: sa.Engine, job_id: uuid.UUID, models: ModelFilter) -> tuple[int, float]:
    """(items claimed, Postgres CPU seconds) of claiming all a worker of `models` may take."""
    before, taken = cpu_snapshot(), 0
    while True:
        with db.begin() as conn:
            got = ledger.claim(conn, job_id, owner="w", n=CLAIM_N, lease_s=600, models=models)
        if not got:
            return taken, cpu_used(before).get("postgres", 0.0)
        taken += len(got)


def median_ms(probe: Callable[[sa.Connection], object], db: sa.Engine, calls: int = 40) -> float:
    with db.connect() as conn:
        times = []
        for _ in range(calls):
            started = time.perf_counter()
            probe(conn)
            times.append(time.perf_counter() - started)
    return statistics.median(times[10:]) * 1000  # past the generic plan's switch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=60_000, help="items of the mixed job")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-ledger-models-"))
    env = {"THINKBATCH_MAX_ITEMS_PER_JOB": str(max(args.items, 100_000)), "THINKBATCH_MODEL": BASE}
    with local_stack(tmp, env=env, database="ledger", engine=False, demo_model=False) as local:
        settings = local.settings.model_copy(update={"served_models": [BASE, *ADAPTERS]})
        db = sa.create_engine(local.database_url)
        share = args.items // (len(ADAPTERS) + 1) * 2  # what each worker takes
        per_item: dict[str, list[float]] = {"one model (baseline)": []}
        for r in range(args.rounds):
            single = submit(db, settings, share, mixed=False)
            n, cpu = claim_all(db, single.id, ModelFilter.of(BASE, single.models, [BASE]))
            per_item["one model (baseline)"].append(cpu / n * 1e6)
            for name, served in WORKERS.items():
                job = submit(db, settings, args.items, mixed=True)
                n, cpu = claim_all(db, job.id, ModelFilter.of(job.model, job.models, served))
                assert n == share, (name, n)
                per_item.setdefault(name, []).append(cpu / n * 1e6)
            print(f"round {r + 1} done", flush=True)
        base = statistics.median(per_item["one model (baseline)"])
        print(f"claims of {CLAIM_N}, Postgres CPU per item claimed (median of {args.rounds}):")
        for name, values in per_item.items():
            every = " ".join(f"{v:.1f}" for v in values)
            median = statistics.median(values)
            print(f"  {name:<30} {median:6.1f} us  x{median / base:.2f}  ({every})")
        # The last mixed job: the served names' items are all claimed, the rest pending.
        models = ModelFilter.of(job.model, job.models, WORKERS["base and one adapter"])
        probes: dict[str, Callable[[sa.Connection], object]] = {
            "has_pending": lambda c: ledger.has_pending(c, job.id, models),
            "has_suspects": lambda c: ledger.has_suspects(c, job.id, models),
            "job_to_adopt": lambda c: ledger.job_to_adopt(c, models=[BASE, "a1"], exclude=[]),
            "an empty claim": lambda c: ledger.claim(
                c, job.id, owner="w", n=CLAIM_N, lease_s=600, models=models
            ),
        }
        rest = args.items - share
        print(f"a worker of the base and a1, its items claimed, {rest:,} of others pending:")
        for name, probe in probes.items():
            print(f"  {name:<30} {median_ms(probe, db):6.2f} ms a call (median)")
        db.dispose()


if __name__ == "__main__":
    main()
