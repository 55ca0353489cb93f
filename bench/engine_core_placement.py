"""Where vLLM's engine core should run on a CPU-only host: one raw engine (bench/raw_arm.py), its
engine-core process moved between rounds from the cores vLLM reserves to the cores its model
threads are bound to and back (CPU_ENGINE_CORE, worker/affinity.py), in alternating order, at
each length. One engine for both placements, so that start-up and the host's drift between
runs do not decide the answer.

`python -m bench.engine_core_placement` prints every round and, per length, the median of
each placement and their ratio. The raw engine's speed is what the setting must not cost;
what the job system gains from the freed reserved core shows only in `make bench`.
"""

from __future__ import annotations

import argparse
import os
import statistics

import psutil

from bench.cpu import wait_engines_idle
from bench.raw_arm import RawArm
from bench.workload import CPU_BENCH
from devstack.demo_model import build_demo_model
from devstack.demo_model import demo_model_env
from devstack.stack import engine_env
from worker.affinity import bound_cores
from worker.affinity import is_engine_core
from worker.affinity import pin_threads


def placements(root: int) -> tuple[set[int], set[int], list[psutil.Process]]:
    """The cores vLLM bound its model worker (`VLLM::Worker`) to, the rest, and the engine-core
    processes. By name: the worker has pinned its own helpers to the rest by now, so that a
    bound mask alone no longer tells vLLM's compute processes apart."""
    everything = set(os.sched_getaffinity(0))
    compute: set[int] = set()
    engine_core = []
    for proc in psutil.Process(root).children(recursive=True):
        if is_engine_core(proc):
            engine_core.append(proc)
        elif proc.name().startswith("VLLM::Worker"):
            compute |= bound_cores(proc, everything)
    return compute, everything - compute, engine_core


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=positive, default=2000)
    parser.add_argument("--rounds", type=positive, default=4, help="rounds of each placement")
    parser.add_argument("--lengths", default="64,16", help="output tokens, comma-separated")
    args = parser.parse_args()
    lengths = list(dict.fromkeys(positive(t) for t in args.lengths.split(",") if t.strip()))
    # Start with the engine core where `reserved` puts it; the rounds then move it.
    env = {
        **os.environ,
        **engine_env(CPU_BENCH),
        **demo_model_env(build_demo_model()),
        "THINKBATCH_CPU_ENGINE_CORE": "reserved",
    }
    arm = RawArm(env, args.items, max(lengths))
    seconds: dict[tuple[int, str], list[float]] = {}
    try:
        arm.wait_ready()
        compute, reserved, engine_core = placements(arm.proc.pid)
        if not compute or not reserved or not engine_core:
            raise SystemExit(
                "no compute cores, no reserved ones or no engine core found (a GPU host?): "
                "nothing to compare"
            )
        where = {"compute": compute, "reserved": reserved}
        print(f"compute cores {sorted(compute)}, reserved {sorted(reserved)}; engine core: "
              + ", ".join(f"{p.pid} {p.name()}" for p in engine_core))  # fmt: skip
        round_no = 1
        pairs = 0  # across lengths, so that each placement goes first as often as the other
        for tokens in lengths:
            arm.round(round_no, tokens)  # warm-up at this length
            round_no += 1
            for _ in range(args.rounds):
                order = ["reserved", "compute"] if pairs % 2 == 0 else ["compute", "reserved"]
                pairs += 1
                for name in order:
                    for proc in engine_core:
                        pin_threads(proc, where[name])
                    wait_engines_idle()
                    result = arm.round(round_no, tokens)
                    round_no += 1
                    seconds.setdefault((tokens, name), []).append(result["seconds"])
                    print(f"  {tokens:3d} tokens, engine core on {name:8}: "
                          f"{result['seconds']:.2f} s, {args.items / result['seconds']:.1f} "
                          "items/s", flush=True)  # fmt: skip
    finally:
        arm.close()
    for tokens in lengths:
        med = {name: statistics.median(seconds[(tokens, name)]) for name in where}
        rate = {name: args.items / med[name] for name in where}
        print(
            f"{tokens} tokens, {args.items} items: reserved {rate['reserved']:.1f} items/s, "
            f"compute {rate['compute']:.1f} items/s (medians of {args.rounds}); "
            f"compute / reserved {med['reserved'] / med['compute']:.3f}"
        )


if __name__ == "__main__":
    main()
