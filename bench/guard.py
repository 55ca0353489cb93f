"""The guard's two readers on the same bytes (`python -m bench.guard`): a job body of plain items
(bench/scale.py's, as `make bench-scale` submits it) and a batch file's lines, read by the exact
reader alone (thinkbatch/guard_events.py) and by the guard as shipped (the fast reader, which
hands a body to the exact one only where it is not certain: thinkbatch/guard_fast.py). Prints
the CPU per item of each (the calling thread's clock, the values built and dropped as the API
drops them), every round, arms interleaved with their order turning, and the ratio.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from bench.scale import body
from thinkbatch.guard import Limits
from thinkbatch.guard import read_body
from thinkbatch.guard import read_object
from thinkbatch.guard_events import read_events
from thinkbatch.settings import Settings


def _line(n: int) -> bytes:
    line = {
        "custom_id": f"request-{n}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": "thinkbatch-demo",
            "messages": [
                {"role": "system", "content": "You are a careful assistant."},
                {"role": "user", "content": f"Question {n}: summarise continuous batching."},
            ],
            "max_tokens": 512,
        },
    }
    return json.dumps(line).encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    settings = Settings()
    limits = Limits.of(settings)
    whole = Limits.of(settings, items_key=None)
    data = json.dumps(body(args.items)).encode()
    lines = [_line(n) for n in range(args.lines)]

    def job(reader: Callable[..., Any]) -> Callable[[], int]:
        return lambda: sum(1 for kind, _ in reader(io.BytesIO(data), limits) if kind == "item")

    def exact_line(line: bytes) -> dict[str, Any]:
        return {key: value for _, (key, value) in read_events(io.BytesIO(line), whole)}

    def file(read: Callable[[bytes], Any]) -> Callable[[], int]:
        return lambda: sum(1 for line in lines if read(line))

    cases = [
        (f"job body, {args.items:,} items", args.items, job(read_events), job(read_body)),
        (
            f"batch file, {args.lines:,} lines",
            args.lines,
            file(exact_line),
            file(lambda line: read_object(line, limits)),
        ),
    ]
    print(
        f"benchmark: the guard's readers, {args.rounds} rounds per case, arms interleaved "
        "(order turning); CPU per item, us"
    )
    for name, count, exact, fast in cases:
        times: dict[str, list[float]] = {"exact": [], "shipped": []}
        for round_ in range(args.rounds):
            arms = [("exact", exact), ("shipped", fast)]
            for arm, run in arms if round_ % 2 == 0 else arms[::-1]:
                start = time.thread_time()
                assert run() == count
                times[arm].append((time.thread_time() - start) * 1e6 / count)
        medians = {arm: statistics.median(every) for arm, every in times.items()}
        for arm, every in times.items():
            rounds = " ".join(f"{t:.2f}" for t in every)
            print(f"{name:<28} {arm:<8} {medians[arm]:6.2f}  ({rounds})")
        print(f"{name:<28} shipped / exact: {medians['shipped'] / medians['exact']:.2f}")
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
