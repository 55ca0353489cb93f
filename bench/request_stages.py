"""CPU of a request by stage, in-process: each of the app's request hooks and its view, timed
on the calling thread's CPU clock (worker/stages.py's StageClock), so that waiting on Postgres
or Redis is not counted. Flask's test client runs every hook and the view in the calling thread;
what is left of a call's CPU (Werkzeug's request and response, routing, the test client) is
printed as the rest. `python -m bench.poll_cpu --stages` prints it for a status call and a page.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from flask import Flask

from worker.stages import StageClock


class RequestStages:
    """Wraps the hooks and views `app` has now; `cpu()` is the CPU spent in each so far."""

    def __init__(self, app: Flask):
        self._clock = StageClock(())
        tables = (
            ("before", app.before_request_funcs),
            ("after", app.after_request_funcs),
            ("teardown", app.teardown_request_funcs),
        )
        for kind, table in tables:
            for blueprint, funcs in table.items():
                table[blueprint] = [self._timed(f"{kind} {_name(f)}", f) for f in funcs]
        for endpoint, view in list(app.view_functions.items()):
            app.view_functions[endpoint] = self._timed(f"view {endpoint}", view)

    def _timed(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._clock.measure(stage):
                return fn(*args, **kwargs)

        return timed

    def reset(self) -> None:
        self._clock = StageClock(())

    def cpu(self) -> dict[str, float]:
        """Seconds of CPU by stage since the last reset, the largest first."""
        return dict(sorted(self._clock.snapshot().items(), key=lambda kv: -kv[1]))


def _name(fn: Callable[..., Any]) -> str:
    return f"{fn.__module__}.{getattr(fn, '__qualname__', repr(fn)).replace('.<locals>', '')}"


def report(stages: dict[str, float], total_s: float, calls: int) -> list[str]:
    """Lines of microseconds per call by stage, with each one's share of the call's CPU."""
    lines = []
    for stage, seconds in [*stages.items(), ("rest (Werkzeug, routing, the test client)",
                                            total_s - sum(stages.values()))]:  # fmt: skip
        share = seconds / total_s * 100 if total_s else 0.0
        lines.append(f"  {seconds / calls * 1e6:8.1f} us  {share:4.1f}%  {stage}")
    return lines
