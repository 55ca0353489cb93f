"""The raw arm of `make bench`: the worker's own vLLM adapter, fed every prompt at once, in a
child process of its own (`python -m bench.raw_arm`), so that its engine can run beside the
job system's and the parent can interleave the rounds of both."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from typing import Any

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.workload import prompts
from devstack.stack import ROOT
from thinkbatch.settings import get_settings

RAW_MARK = "RAW-ARM "


def serve_raw(n: int, max_tokens: int) -> None:
    """The raw arm, in this (child) process: the worker's adapter fed all prompts at once. It
    runs a round for each `round R` line on stdin, so that the parent can interleave the arms
    and both see the same moments of a noisy host."""
    import asyncio
    import gc
    import uuid

    from thinkbatch.ledger import Claimed
    from thinkbatch.sampling import resolve_sampling
    from worker.vllm_engine import VLLMEngine

    settings = get_settings()
    engine = VLLMEngine(settings)

    async def main() -> None:
        await engine.start()
        # As the worker does once it is ready (worker/lifecycle.py), and `vllm serve` after
        # its start-up: the arms differ only by the job system.
        gc.collect()
        gc.freeze()
        print(RAW_MARK + "ready", flush=True)
        while True:
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line.startswith("round "):
                break
            _, round_no, tokens = line.split()
            result = await one_round(int(round_no), int(tokens))
            print(RAW_MARK + json.dumps(result), flush=True)
        await engine.shutdown()

    async def one_round(round_no: int, tokens: int) -> dict[str, Any]:
        params = {"ignore_eos": True, "max_tokens": tokens, "temperature": 0}
        items = [
            Claimed(k, uuid.uuid4(), k, p["custom_id"], p["messages"], None, None, 1, 0)
            for k, p in enumerate(prompts(n, round_no))
        ]
        sampling = [resolve_sampling(params, None, default_max_tokens=tokens)] * n
        prepared = engine.prepare(items, sampling)
        finished: list[float] = []

        async def one(k: int, p: Any) -> Any:
            out = await engine.generate(f"raw-{round_no}-{tokens}-{k}", p)
            finished.append(time.perf_counter())
            return out

        cpu_before = cpu_snapshot()
        load_before = engine.scheduler_load()
        started = time.perf_counter()
        outs = await asyncio.gather(*(one(k, p) for k, p in enumerate(prepared)))
        elapsed = time.perf_counter() - started
        cpu = cpu_used(cpu_before)
        load = engine.scheduler_load()
        assert load is not None  # the engine has stepped
        return {
            "seconds": elapsed,
            "steps": load.steps - (load_before.steps if load_before else 0),
            "step_requests": load.step_requests - (load_before.step_requests if load_before else 0),
            "first_result_seconds": min(finished) - started,
            "cpu": cpu,
            "output_tokens": sum(len(o.token_ids) for o in outs),
        }

    asyncio.run(main())


class RawArm:
    """The parent's handle on the raw arm's process."""

    def __init__(self, env: dict[str, str], n: int, max_tokens: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.raw_arm",
             "--items", str(n), "--max-tokens", str(max_tokens)],
            env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip

    def _reply(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(RAW_MARK):
                return line[len(RAW_MARK) :].strip()
        raise RuntimeError(f"the raw arm exited with {self.proc.wait()}")

    def wait_ready(self) -> None:
        self._reply()

    def round(self, round_no: int, max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"round {round_no} {max_tokens}\n")
        self.proc.stdin.flush()
        result: dict[str, Any] = json.loads(self._reply())
        return result

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="the raw arm's child process (bench.throughput)")
    parser.add_argument("--items", type=int, required=True)
    parser.add_argument("--max-tokens", type=int, required=True)
    args = parser.parse_args()
    serve_raw(args.items, args.max_tokens)


if __name__ == "__main__":
    main()
