"""The chaos and multi-host tiers' tables: a line per scenario, printed once at the end of the run.

A scenario appends its line (tests/chaos/helpers.py, tests/hosts/helpers.py) in the process that
ran it. `make test` runs the process tiers under pytest-xdist, where that is a worker process
and the terminal belongs to the controller: each worker hands its lines over in its output at
the end of its session (`collect`), the controller takes them in as the worker goes down
(`receive`) and prints the tables (`write`), so they read the same however the run is split."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from tests.chaos.helpers import REPORTS as CHAOS
from tests.chaos.helpers import ScenarioReport
from tests.hosts.helpers import REPORTS as HOSTS
from tests.hosts.helpers import HostReport

_KEY = "scenario_reports"
_TIERS: dict[str, tuple[list[Any], type[Any]]] = {
    "chaos": (CHAOS, ScenarioReport),
    "hosts": (HOSTS, HostReport),
}
_TITLES = {
    "chaos": ("chaos scenarios (every item terminal, one result per item, counts = items):",),
    "hosts": (
        "multi-host scenarios (every item terminal, one result per item, counts = items;",
        "fenced: late writes of the faulty host refused by the fence; times from the fault,",
        "b rows from its end):",
    ),
}


def collect(workeroutput: dict[str, Any]) -> None:
    """In a worker: its lines, as plain values, into the output xdist sends the controller."""
    workeroutput[_KEY] = {tier: [asdict(r) for r in rows] for tier, (rows, _) in _TIERS.items()}


def receive(workeroutput: dict[str, Any]) -> None:
    """In the controller: a worker's lines, appended to the tiers' own lists."""
    for tier, rows in workeroutput.get(_KEY, {}).items():
        reports, kind = _TIERS[tier]
        reports.extend(kind(**row) for row in rows)


def write(line: Callable[[str], object]) -> None:
    """Each tier's table that has lines, through `line` (the terminal reporter's write_line)."""
    for tier, (rows, _) in _TIERS.items():
        if not rows:
            continue
        fenced = tier == "hosts"
        line("")
        for title in _TITLES[tier]:
            line(title)
        line(
            f"{'scenario':40} {'items':>5} {'faults':>6} {'lost':>4} {'dup':>4} "
            + (f"{'fenced':>6} " if fenced else "")
            + f"{'recover_s':>9} {'finish_s':>8}"
        )
        for r in sorted(rows, key=_order):
            line(
                f"{r.name:40} {r.items:>5} {r.faults:>6} {r.lost:>4} {r.duplicated:>4} "
                + (f"{r.fenced:>6} " if fenced else "")
                + f"{r.recover_s:>9.1f} {r.finish_s:>8.1f}  {r.note}"
            )


def _order(report: Any) -> tuple[int, str]:
    """By scenario number (`2b.` after `2.`), whichever worker ran it first."""
    number = re.match(r"\d+", report.name)
    return (int(number.group()) if number else 0, report.name)
