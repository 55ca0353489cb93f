"""Claims in prefix order against the job's own order, on the real engine (`make bench-prefix`).

A job asks each of `--docs` documents `--questions` questions, the document first in each
item's prompt, listed question by question (the order a batch file built from a table of
questions takes): the items of one document are `--docs` places apart. Two APIs on one stack
store the same job, one with CLAIM_ORDER=prefix (the default: each document's questions are
claimed together) and one with CLAIM_ORDER=submitted (the job's order); one worker runs both.
The arms' rounds are interleaved, their order turning each round, and every round's documents
are new, so that no job finds another's documents in the cache.

The engine's KV cache is kept to `--blocks` blocks of `--block-size` tokens, well below what all
of a job's documents take: as on a GPU serving a real job, it cannot hold every document of the
job until the document's last question comes. The documents are long and the answers short
(`--max-tokens`), so a prompt's prefill is most of an item's work, as for a long document on a
GPU. Printed per arm: items/s (submit to `completed`), the prefix cache's hit rate over the job
(prompt tokens found in the cache / looked up, from the worker's /metrics), and the ratio of
the two arms' items/s per round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from bench.cpu import wait_engines_idle
from bench.system_arm import job_round
from bench.workload import CPU_BENCH
from devstack import local_stack
from devstack.services import free_port
from devstack.stack import readiness_wait
from thinkbatch.keys import issue_key

ARMS = ("prefix", "submitted")
WORDS = (
    "river", "market", "engine", "harbour", "signal", "ledger", "copper", "garden", "winter",
    "lantern", "orbit", "meadow", "circuit", "granite", "canvas", "tunnel", "falcon", "quartz",
)  # fmt: skip


def document(round_no: int, k: int, words: int) -> str:
    """A document of its own from the first words on: no two share a cached block."""
    rng = random.Random(f"{round_no}-{k}")  # noqa: S311 - text to run, not a secret
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Report {round_no}-{k}. {body}"


def job_items(round_no: int, docs: int, questions: int, words: int) -> list[dict[str, Any]]:
    """Question by question: item q * docs + d asks document d its question q."""
    texts = [document(round_no, d, words) for d in range(docs)]
    return [
        {
            "custom_id": f"d{d}-q{q}",
            "messages": [
                {"role": "user", "content": f"{texts[d]}\n\nQuestion {q}: which word comes {q}th?"}
            ],
        }
        for q in range(questions)
        for d in range(docs)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--docs", type=int, default=192)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--words", type=int, default=120, help="words per document")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=512, help="KV cache blocks")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV cache block")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    args = parser.parse_args()

    engine = {
        **CPU_BENCH,
        "THINKBATCH_MAX_NUM_SEQS": str(args.max_num_seqs),
        "THINKBATCH_MAX_MODEL_LEN": "1024",
    }
    # The worker's alone: the stack's settings are read without JSON-valued ones.
    cache = json.dumps({"num_gpu_blocks_override": args.blocks, "block_size": args.block_size})
    n = args.docs * args.questions
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-bench-prefix-"))
    rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with ExitStack() as teardown:
        local = teardown.enter_context(
            local_stack(tmp, database="bench_prefix", cpu_overrides=engine)
        )
        stack, settings = local.stack, local.settings
        print(
            f"benchmark: one job of {args.docs} documents x {args.questions} questions "
            f"({n} items, listed question by question), about {args.words} words a document, "
            f"max_tokens {args.max_tokens} (ignore_eos), {args.rounds} rounds per arm, "
            f"interleaved (order turning); model {settings.model_name}",
            flush=True,
        )
        print(
            f"engine: KV cache {args.blocks} blocks x {args.block_size} tokens, max_num_seqs "
            f"{args.max_num_seqs}, enable_prefix_caching {settings.enable_prefix_caching}",
            flush=True,
        )
        apis = {
            arm: stack.start_api(workers=1, env={"THINKBATCH_CLAIM_ORDER": arm}, name=f"api-{arm}")
            for arm in ARMS
        }
        port = free_port()
        worker = stack.start_worker(
            "worker",
            env={
                "THINKBATCH_WORKER_METRICS_PORT": str(port),
                "THINKBATCH_ENGINE_EXTRA_ARGS": cache,
            },
            wait=False,
        )
        stack.wait_worker_ready(worker, **readiness_wait(settings))
        key = issue_key(local.database_url, "bench", "make bench-prefix")
        clients = {
            arm: teardown.enter_context(
                httpx.Client(
                    base_url=f"http://127.0.0.1:{api.port}",
                    timeout=300,
                    headers={"Authorization": f"Bearer {key}"},
                )
            )
            for arm, api in apis.items()
        }
        db = sa.create_engine(local.database_url)
        teardown.callback(db.dispose)
        params = {"max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0}
        for r in range(args.rounds):
            for k, arm in enumerate(ARMS[r % 2 :] + ARMS[: r % 2]):
                wait_engines_idle()
                body = {"items": job_items(2 * r + k, args.docs, args.questions, args.words)}
                result = job_round(clients[arm], db, {**body, "params": params}, port)
                if result["succeeded"] != n:
                    raise RuntimeError(f"the benchmark job did not complete: {result['job']}")
                rounds[arm].append(result)
    report(rounds, n)


def report(rounds: dict[str, list[dict[str, Any]]], n: int) -> None:
    print(f"{'arm':10} {'items/s':>8} {'hit rate':>9} {'prompt tok':>11}  (median; every round)")
    for arm in ARMS:
        rates = [n / r["seconds"] for r in rounds[arm]]
        hits = [r["prefix_hits"] / max(r["prefix_queries"], 1) for r in rounds[arm]]
        prompt = statistics.median(r["job"]["usage"]["prompt_tokens"] for r in rounds[arm])
        print(
            f"{arm:10} {statistics.median(rates):8.1f} {statistics.median(hits):9.1%} "
            f"{prompt:11,.0f}  ({' '.join(f'{x:.1f}' for x in rates)}; "
            f"{' '.join(f'{h:.1%}' for h in hits)})"
        )
    ratios = [s["seconds"] / p["seconds"] for p, s in zip(*rounds.values(), strict=True)]
    print(
        f"ratio (prefix / submitted, items/s): median of rounds {statistics.median(ratios):.2f}; "
        f"round by round: {' '.join(f'{x:.2f}' for x in ratios)}"
    )
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )


if __name__ == "__main__":
    main()
