"""Speculative decoding on and off, same engine settings, same prompts (`make bench
ARGS=--speculative`).

Prompt lookup (vLLM's `ngram` method) drafts tokens by finding the last few generated tokens
earlier in the context, so it helps where answers quote the prompt. The prompt set is built to
be such a case on any model: the model first answers a set of questions (greedy, no
speculation); each benchmark conversation then holds that question, the model's own answer as
an earlier assistant turn, and the same question again. The arms then run, each in a process of
its own (one engine per process), greedy with thinking on:

* batch: every conversation submitted at once (the job system's case);
* one at a time: the first few, sequentially (the latency case, where speculation pays most).

It prints output tokens/s and items/s of both arms, their ratio, and the engine's acceptance
figures (drafted and accepted tokens, acceptance rate and length, per draft position).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from devstack.demo_model import build_demo_model
from devstack.demo_model import demo_model_env
from devstack.demo_model import wants_demo_model
from devstack.stack import ROOT
from devstack.stack import child_settings
from devstack.stack import engine_env
from thinkbatch.settings import Settings

CPU_SPEC = {
    "THINKBATCH_MAX_NUM_SEQS": "64",
    "THINKBATCH_CPU_KVCACHE_SPACE_GIB": "2",
    "THINKBATCH_MAX_MODEL_LEN": "1024",
}
QUESTIONS = [
    "What is continuous batching in vLLM?",
    "What does PagedAttention do?",
    "What is the KV cache?",
    "Why does left padding matter in batch inference?",
    "Explain quantum entanglement.",
    "Is a bigger batch size always better?",
    "什么是连续批处理？",
    "解释量子纠缠现象",
]


def ngram_config(k: int) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
            "prompt_lookup_max": 5}  # fmt: skip


def run_arm(args: argparse.Namespace) -> None:
    """One arm, in this (child) process; writes its JSON to the file --out names (not to
    stdout, which vLLM's logging shares: a log line can land inside a printed one)."""
    import asyncio

    from thinkbatch.ledger import Claimed
    from thinkbatch.sampling import resolve_sampling
    from worker.vllm_engine import VLLMEngine

    overrides: dict[str, Any] = {}
    if args.arm == "ngram":
        overrides["speculative_config"] = ngram_config(args.k)
    engine = VLLMEngine(Settings(**overrides))
    greedy = resolve_sampling(
        {"temperature": 0, "max_tokens": args.max_tokens}, None, default_max_tokens=64
    )
    prompts_file = Path(args.prompts)

    def claimed(conversations: list[list[dict[str, str]]]) -> list[Claimed]:
        return [
            Claimed(k, uuid.uuid4(), k, f"s{k}", messages, None, None, 1, 0)
            for k, messages in enumerate(conversations)
        ]

    async def generate(conversations: list[list[dict[str, str]]], batch: bool) -> list[Any]:
        prepared = engine.prepare(claimed(conversations), [greedy] * len(conversations))
        if batch:
            return await asyncio.gather(
                *(engine.generate(f"r-{uuid.uuid4()}", p) for p in prepared)  # type: ignore[arg-type]
            )
        return [await engine.generate(f"r-{uuid.uuid4()}", p) for p in prepared]  # type: ignore[arg-type]

    async def main() -> dict[str, Any]:
        await engine.start()
        if not prompts_file.exists():  # the first arm writes the quoting prompt set
            asked = [[{"role": "user", "content": q}] for q in QUESTIONS]
            answers = await generate(asked, batch=True)
            sets = []
            for k in range(args.items):
                question = QUESTIONS[k % len(QUESTIONS)]
                answer = answers[k % len(QUESTIONS)].text.rsplit("</think>", 1)[-1].strip()
                sets.append([
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": question},
                ])  # fmt: skip
            prompts_file.write_text(json.dumps(sets))
        conversations = json.loads(prompts_file.read_text())
        await generate(conversations[:4], batch=True)  # warm-up
        before = engine.speculative_stats()
        result: dict[str, Any] = {"arm": args.arm}
        for name, batch, chosen in (
            ("batch", True, conversations),
            ("one at a time", False, conversations[: args.one_at_a_time]),
        ):
            best: dict[str, Any] | None = None
            for _ in range(args.rounds):
                started = time.perf_counter()
                outs = await generate(chosen, batch)
                seconds = time.perf_counter() - started
                if best is None or seconds < best["seconds"]:
                    best = {"seconds": seconds, "items": len(chosen),
                            "output_tokens": sum(len(o.token_ids) for o in outs),
                            "texts": [o.text for o in outs]}  # fmt: skip
            result[name] = best
        stats = engine.speculative_stats()
        if stats is not None and before is not None:
            stats.add(-before.drafts, -before.draft_tokens, -before.accepted_tokens,
                      [-n for n in before.accepted_per_position])  # fmt: skip
        result["speculative"] = stats.as_dict() if stats is not None else None
        result["summary"] = stats.summary() if stats is not None else None
        await engine.shutdown()
        return result

    Path(args.out).write_text(json.dumps(asyncio.run(main())))


def spawn_arm(arm: str, args: argparse.Namespace, env: dict[str, str], prompts: Path) -> Any:
    cmd = [sys.executable, "-m", "bench.speculative", "--arm", arm, "--prompts", str(prompts),
           "--items", str(args.items), "--max-tokens", str(args.max_tokens),
           "--rounds", str(args.rounds), "--k", str(args.k),
           "--one-at-a-time", str(args.one_at_a_time)]  # fmt: skip
    out = prompts.with_name(f"{arm}.json")
    cmd += ["--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode == 0 and out.exists():
        return json.loads(out.read_text())
    raise RuntimeError(f"the {arm} arm failed ({proc.returncode}): {proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=64, help="conversations in the batch")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each load; best kept")
    parser.add_argument("--k", type=int, default=4, help="tokens drafted per step")
    parser.add_argument("--one-at-a-time", type=int, default=8, help="items run sequentially")
    parser.add_argument("--arm", choices=("off", "ngram"), help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.arm:
        run_arm(args)
        return 0

    env = engine_env(CPU_SPEC)
    if wants_demo_model(child_settings(env)):
        env.update(demo_model_env(build_demo_model()))
    settings = child_settings(env)
    child_env = {**os.environ, **env}
    prompts = Path(tempfile.mkdtemp(prefix="thinkbatch-spec-")) / "prompts.json"
    print(f"speculative decoding benchmark: ngram prompt lookup, k={args.k}; model "
          f"{settings.model_name}; {args.items} conversations whose answer quotes the prompt; "
          f"greedy, max_tokens {args.max_tokens}; best of {args.rounds}", flush=True)  # fmt: skip
    off = spawn_arm("off", args, child_env, prompts)
    on = spawn_arm("ngram", args, child_env, prompts)
    print(f"{'load':14} {'arm':8} {'items/s':>8} {'out tok/s':>10} {'seconds':>8}")
    for load in ("batch", "one at a time"):
        for arm in (off, on):
            r = arm[load]
            print(f"{load:14} {arm['arm']:8} {r['items'] / r['seconds']:8.2f} "
                  f"{r['output_tokens'] / r['seconds']:10.1f} {r['seconds']:8.2f}")  # fmt: skip
        ratio = off[load]["seconds"] / on[load]["seconds"]
        same = off[load]["texts"] == on[load]["texts"]
        print(f"{load:14} speed-up with speculation: {ratio:.2f}x; greedy outputs identical: "
              f"{same}")  # fmt: skip
    print(on["summary"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
