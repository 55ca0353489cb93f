"""Where the raw engine's CPU goes, thread by thread: one round of the raw arm (bench/raw_arm.py),
with each thread of its process tree read from /proc before and after (Linux only).

`python -m bench.engine_threads` prints, for every thread that used more than 0.02 s, its process
and thread names, CPU seconds, the cores it may run on and the core it ran on last. On this CPU
it shows vLLM's model worker on the cores vLLM bound it to and the engine core's loop where
CPU_ENGINE_CORE put it (beside the single compute core by default; `reserved`: on the core the
job system's worker, Postgres and API use).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import psutil

from bench.raw_arm import RawArm
from bench.workload import CPU_BENCH
from devstack.demo_model import build_demo_model
from devstack.demo_model import demo_model_env
from devstack.stack import engine_env


@dataclass(frozen=True)
class ThreadCpu:
    process: str
    thread: str
    ticks: int  # user + system, in clock ticks
    cores: list[int]
    last_core: int


def threads_of(pid: int) -> dict[int, ThreadCpu]:
    """Every thread of `pid` and its descendants, by thread id."""
    root = psutil.Process(pid)
    out: dict[int, ThreadCpu] = {}
    for proc in [root, *root.children(recursive=True)]:
        for thread in proc.threads():
            task = f"/proc/{proc.pid}/task/{thread.id}"
            try:
                with open(f"{task}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)"
                with open(f"{task}/comm") as f:
                    name = f.read().strip()
                cores = sorted(os.sched_getaffinity(thread.id))
            except OSError:  # the thread ended meanwhile
                continue
            # Fields after the name, from `state` (field 3 of proc(5)) on: utime is 14, stime
            # 15 and processor 39 there.
            out[thread.id] = ThreadCpu(
                proc.name(), name, int(fields[11]) + int(fields[12]), cores, int(fields[36])
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    env = {**os.environ, **engine_env(CPU_BENCH), **demo_model_env(build_demo_model())}
    arm = RawArm(env, args.items, args.max_tokens)
    try:
        arm.wait_ready()
        arm.round(1, args.max_tokens)  # warm-up
        before = threads_of(arm.proc.pid)
        started = time.perf_counter()
        result = arm.round(2, args.max_tokens)
        wall = time.perf_counter() - started
        after = threads_of(arm.proc.pid)
    finally:
        arm.close()
    tick = os.sysconf("SC_CLK_TCK")
    seconds = result["seconds"]
    print(f"raw engine, {args.items} items x {args.max_tokens} tokens: round {seconds:.2f} s "
          f"(wall {wall:.2f} s)")  # fmt: skip
    used = {
        tid: (t.ticks - (before[tid].ticks if tid in before else 0)) / tick
        for tid, t in after.items()
    }
    for tid, cpu in sorted(used.items(), key=lambda kv: -kv[1]):
        if cpu > 0.02:
            t = after[tid]
            print(f"  {t.process[:20]:20} {t.thread[:20]:20} {cpu:5.2f} s CPU  "
                  f"cores {t.cores}, last on {t.last_core}")  # fmt: skip


if __name__ == "__main__":
    main()
