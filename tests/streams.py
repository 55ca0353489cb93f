"""`--streams`: how `make test` shares this machine's two cores among the process tiers.

`make test` runs the tiers with real processes as `pytest -n 2 --streams`, two worker processes
that each run one test at a time. The tests of the real vLLM engine (marker `e2e` or `engine`)
are one unit of work, run one after another by one worker: each keeps a core busy with the
model, and two engines at once would bind their compute to the same core. Every other test
module is a unit of its own (its module fixtures are built once), taken by whichever worker is
free. Those tests (stacks and chaos on the fake engine, the hosts in network namespaces, the
package-index checks) mostly wait, on timers, sockets and networks, at a tenth to a third of the
machine's CPU, so they overlap the engine's tests with little contention. The longest units go
first (the engine's, then the hosts tier, then the chaos suite), so that none of them is left
for the end.

xdist's own `--dist loadgroup` cannot say this under pytest 9: it marks a group by suffixing the
item's `_nodeid`, which pytest 9 no longer reads. Here the workers tell the controller each
test's unit in a file (the controller only ever sees node ids), and a scheduler of the
controller's hands the units out.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

ENGINE = "engine"
# The longest units first: after the engine's, these modules, in this order; then the rest.
_FIRST = ("tests/hosts/", "tests/chaos/")
_INPUT = "thinkbatch_streams"  # the key of the map's folder in each worker's workerinput
_FOLDER = pytest.StashKey[Path]()  # that folder, in the controller's config


def unit_of(item: pytest.Item) -> str:
    """The engine's unit for a test of the real engine, else the test's module."""
    if item.get_closest_marker("e2e") or item.get_closest_marker("engine"):
        return ENGINE
    return item.nodeid.split("::", 1)[0]


def _rank(unit: str) -> int:
    if unit == ENGINE:
        return 0
    return next(
        (k + 1 for k, first in enumerate(_FIRST) if unit.startswith(first)), len(_FIRST) + 1
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--streams",
        action="store_true",
        help="with -n 2: the real engine's tests one after another, the other modules beside them",
    )


def _wanted(config: pytest.Config) -> bool:
    return bool(config.getoption("streams")) and bool(getattr(config.option, "numprocesses", 0))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    if _wanted(config) and not hasattr(config, "workerinput"):
        workers = config.getoption("numprocesses")
        if workers != 2:  # more would run the waiting tests beside each other, on 2 cores
            raise pytest.UsageError(f"--streams shares two cores: use -n 2, not -n {workers}")
        config.stash[_FOLDER] = Path(tempfile.mkdtemp(prefix="thinkbatch-streams-"))


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_FOLDER, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without xdist
def pytest_configure_node(node: Any) -> None:
    folder = node.config.stash.get(_FOLDER, None)
    if folder is not None:
        node.workerinput[_INPUT] = str(folder)


@pytest.hookimpl(trylast=True)  # after -m has deselected: the map holds what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    folder = getattr(config, "workerinput", {}).get(_INPUT)
    if folder is None:
        return
    units = {item.nodeid: unit_of(item) for item in items}
    # Every worker sorts alike (xdist checks that they collected the same list), stably: the
    # controller hands out the units in the order they first appear.
    items.sort(key=lambda item: _rank(units[item.nodeid]))
    mine = Path(folder) / f"{config.workerinput['workerid']}.json"
    partial = mine.with_suffix(".part")
    partial.write_text(json.dumps(units))
    partial.replace(mine)  # whole or absent when the controller reads it


class StreamScheduling(LoadScopeScheduling):
    """LoadScopeScheduling with the units above as its scopes, handed out in the order the
    workers sorted them (not by their number of tests). Every worker has collected the same
    tests (xdist checks it) before a scope is asked for."""

    def __init__(self, config: pytest.Config, log: Any = None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False
        self._folder = config.stash[_FOLDER]
        self._units: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._units is None:
            found = sorted(self._folder.glob("*.json"))
            assert found, "no worker said which unit its tests belong to"
            self._units = json.loads(found[0].read_text())
        return self._units[nodeid]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> StreamScheduling | None:
    if config.stash.get(_FOLDER, None) is None:
        return None
    return StreamScheduling(config, log)
