"""Two models routed vs one model alone, side by side in one run (`make bench-models`).

One API and one worker per model (two models, `model-a` and `model-b`, each worker serving one
name). Two arms, their rounds interleaved so that both see the same moments of the host:

1. one model alone: a job of `--items` items of one model (model-a and model-b by turns); the
   other worker is idle, as if the deployment served that model alone;
2. two models routed: one job of 2 x `--items` items, every other item naming model-b (the rest
   the job's model-a), so each worker claims only its model's items out of the same job.

Each model's rate is its items over the time from the submit to its last stored result. The
ratio (a model's items/s in the routed arm / one model's items/s alone, per round, the lower
of the two models) is the cost of routing: workers that share a job and a database, each
claiming only its own items. Its median over the rounds is printed against the target (0.95).

Both workers run the fake engine at a realistic step time (`step_s` 0.02, 64 sequences: a
decode step of a small model on a GPU), not at `step_s` 0: the workers are then engine-bound,
as on a GPU host, rather than bound by the CPU of this machine, whose two cores would make two
workers at full pipeline speed compete with each other (and with Postgres and the API) and
measure that contention instead of the routing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from datetime import UTC
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.workload import prompts
from devstack import local_stack
from thinkbatch.keys import issue_key

MODELS = ("model-a", "model-b")
TARGET_RATIO = 0.95
STEP_S = 0.02
MAX_NUM_SEQS = 64


def engine_env() -> dict[str, str]:
    return {
        "THINKBATCH_ENGINE": "fake",
        "THINKBATCH_ENGINE_EXTRA_ARGS": json.dumps({"step_s": STEP_S}),
        "THINKBATCH_MAX_NUM_SEQS": str(MAX_NUM_SEQS),
        "THINKBATCH_SERVED_MODELS": json.dumps(list(MODELS)),
    }


def run_job(
    client: httpx.Client, db: sa.Engine, items: list[dict[str, Any]], model: str, tokens: int
) -> dict[str, float]:
    """One job, submit to completed: each model's items/s (its items over the time from the
    submit to its last stored result)."""
    body = {
        "model": model,
        "items": items,
        "params": {"ignore_eos": True, "max_tokens": tokens, "temperature": 0},
    }
    submitted = datetime.now(UTC)
    job = client.post("/v1/jobs", json=body).raise_for_status().json()
    while job["status"] in ("queued", "running"):
        time.sleep(0.25)
        job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
    if job["status"] != "completed" or job["counts"]["succeeded"] != len(items):
        raise RuntimeError(f"the benchmark job did not complete: {job}")
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT coalesce(i.model, j.model), count(*), max(r.created_at),"
                " count(*) FILTER (WHERE w.model <> coalesce(i.model, j.model))"
                " FROM item_results r JOIN items i ON i.id = r.item_id"
                " JOIN jobs j ON j.id = i.job_id JOIN workers w ON w.id = r.worker_id"
                " WHERE r.job_id = :id GROUP BY 1"
            ),
            {"id": job["id"]},
        ).all()
    rates = {}
    for name, n, last, wrong in rows:
        if wrong:
            raise RuntimeError(f"{wrong} items of {name} ran on a worker of another model")
        rates[name] = n / (last - submitted).total_seconds()
    return rates


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=640, help="items per model and job")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each arm")
    args = parser.parse_args()
    n, tokens = args.items, args.max_tokens

    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-bench-models-"))
    print(
        f"benchmark: {n} items x {tokens} output tokens (ignore_eos) per model and job, "
        f"{args.rounds} rounds per arm, interleaved; fake engine, step_s {STEP_S}, "
        f"max_num_seqs {MAX_NUM_SEQS} (engine-bound: at most "
        f"{MAX_NUM_SEQS / (STEP_S * tokens):.0f} items/s per worker)",
        flush=True,
    )
    alone: list[float] = []
    routed: list[dict[str, float]] = []
    with local_stack(tmp, database="bench_models", engine=False, demo_model=False) as local:
        stack = local.stack
        # JSON values: the processes parse them from their environment (the launcher's own
        # settings take keyword values, which would not be).
        stack.env.update(engine_env())
        api = stack.start_api(workers=2)
        for model in MODELS:
            stack.start_worker(model, env={"THINKBATCH_SERVED_MODEL_NAME": model})
        key = issue_key(local.database_url, "bench", "make bench-models")
        db = sa.create_engine(local.database_url)
        with httpx.Client(
            base_url=f"http://127.0.0.1:{api.port}",
            timeout=300,
            headers={"Authorization": f"Bearer {key}"},
        ) as client:
            run_job(client, db, prompts(64, 999), MODELS[0], tokens)  # warm both paths up
            for r in range(args.rounds):
                model = MODELS[r % 2]  # each model alone, by turns
                rate = run_job(client, db, prompts(n, 2 * r), model, tokens)[model]
                alone.append(rate)
                time.sleep(0.5)
                items = prompts(2 * n, 2 * r + 1)
                for k, item in enumerate(items):
                    if k % 2:
                        item["model"] = MODELS[1]
                routed.append(run_job(client, db, items, MODELS[0], tokens))
                print(
                    f"round {r + 1}: alone ({model}) {rate:.1f} items/s; routed "
                    + ", ".join(f"{m} {routed[-1][m]:.1f}" for m in MODELS)
                    + " items/s",
                    flush=True,
                )
                time.sleep(0.5)
        db.dispose()

    paired = [min(rates.values()) / a for a, rates in zip(alone, routed, strict=True)]
    ratio = median(paired)
    print(f"-- {n} items x {tokens} tokens per model --")
    print(f"{'arm':28} {'items/s':>8}  (median; every round)")
    print(f"{'one model alone':28} {median(alone):8.1f}  ({' '.join(f'{x:.1f}' for x in alone)})")
    for m in MODELS:
        each = [rates[m] for rates in routed]
        print(
            f"{'two models routed: ' + m:28} {median(each):8.1f}  "
            f"({' '.join(f'{x:.1f}' for x in each)})"
        )
    print(
        f"ratio (per model routed / one model alone, the lower model): median of rounds "
        f"{ratio:.3f} (target >= {TARGET_RATIO:.2f}: "
        f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}); round by round: "
        f"{' '.join(f'{x:.2f}' for x in paired)}"
    )
    print("items on a worker of another model: 0 (checked every round)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
