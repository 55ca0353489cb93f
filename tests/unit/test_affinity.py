"""On a CPU host the worker keeps itself off the cores vLLM's compute threads are bound to, and
puts vLLM's engine core where CPU_ENGINE_CORE says (beside a single compute core by default)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from devstack.stack import ROOT
from worker.affinity import engine_core_cores

# Run in a child: pinning the pytest process itself would slow every later test.
SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    from worker.affinity import keep_off_compute_cores

    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    everything = sorted(os.sched_getaffinity(0))
    first = everything[0]
    # Stand-ins for vLLM's processes: its model worker, bound to the first core, either whole
    # (taskset) or, as OpenMP runtimes bind, only in a thread of its own; its engine core, by
    # the name vLLM gives it; and a helper of ours (the reaper), both left unbound.
    if sys.argv[3] == "thread":
        bound = subprocess.Popen([sys.executable, "-c", (
            "import os, threading, time\\n"
            "def work():\\n"
            f"    os.sched_setaffinity(0, {{{first}}})\\n"
            "    time.sleep(30)\\n"
            "threading.Thread(target=work).start()\\n"
            "time.sleep(30)\\n"
        )])
    else:
        bound = subprocess.Popen(["taskset", "-c", str(first), *sleeper])
    engine_core = subprocess.Popen([*sleeper, "VLLM::EngineCore"])
    helper = subprocess.Popen(sleeper)
    time.sleep(0.5)
    before = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    before.start()
    kept = keep_off_compute_cores(sys.argv[1], sys.argv[2])
    seen = {}
    after = threading.Thread(target=lambda: seen.update(core=sorted(os.sched_getaffinity(0))))
    after.start(); after.join()
    print(json.dumps({
        "kept": sorted(kept),
        "main": sorted(os.sched_getaffinity(0)),
        "older_thread": sorted(os.sched_getaffinity(before.native_id)),
        "newer_thread": seen["core"],
        "bound": sorted(os.sched_getaffinity(bound.pid)),
        "engine_core": sorted(os.sched_getaffinity(engine_core.pid)),
        "helper": sorted(os.sched_getaffinity(helper.pid)),
    }))
    for proc in (bound, engine_core, helper):
        proc.kill()
    """
)

two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two or more cores and Linux affinity calls",
)


def place(device: str, engine_core: str, bound: str = "process") -> dict[str, list[int]]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, device, engine_core, bound],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    got: dict[str, list[int]] = json.loads(out.stdout)
    return got


@two_cores
@pytest.mark.parametrize("setting", ["auto", "compute"])
def test_the_worker_keeps_off_the_compute_core_and_the_engine_core_joins_it(setting: str) -> None:
    got = place("cpu", setting)
    everything = sorted(os.sched_getaffinity(0))
    compute, rest = everything[:1], everything[1:]
    assert got["kept"] == rest
    # Every thread of the worker, those started before and after, and our own helper.
    assert got["main"] == got["older_thread"] == got["newer_thread"] == got["helper"] == rest
    # The engine core polls while the model computes: beside the single compute thread, not
    # on the cores the worker needs.
    assert got["engine_core"] == compute
    assert got["bound"] == compute  # vLLM's own binding is left as it was


@two_cores
def test_the_engine_core_can_stay_with_the_worker() -> None:
    got = place("cpu", "reserved")
    everything = sorted(os.sched_getaffinity(0))
    rest = everything[1:]
    assert got["kept"] == rest
    assert got["main"] == got["older_thread"] == got["newer_thread"] == rest
    assert got["engine_core"] == got["helper"] == rest
    assert got["bound"] == everything[:1]


@two_cores
def test_a_process_with_one_bound_thread_counts_as_bound() -> None:
    """OpenMP runtimes bind each compute thread, not the process: its main thread's mask
    still names every core, and the process must not be taken for an unbound one."""
    got = place("cpu", "auto", bound="thread")
    everything = sorted(os.sched_getaffinity(0))
    rest = everything[1:]
    assert got["kept"] == rest
    assert got["main"] == got["helper"] == rest
    assert got["engine_core"] == everything[:1]
    assert got["bound"] == everything  # its main thread, left as vLLM's runtime set it


def test_auto_keeps_the_engine_core_off_several_compute_cores() -> None:
    # With several compute threads a poller on one of their cores holds up each parallel region.
    assert engine_core_cores("auto", {0}, {1}) == {0}
    assert engine_core_cores("auto", {0, 1, 2}, {3}) == {3}
    assert engine_core_cores("compute", {0, 1, 2}, {3}) == {0, 1, 2}
    assert engine_core_cores("reserved", {0}, {1}) == {1}


def test_nothing_changes_without_bound_children() -> None:
    """A CPU host where vLLM bound nothing: the worker keeps every core."""
    script = (
        "import os, json; from worker.affinity import keep_off_compute_cores; "
        "kept = keep_off_compute_cores('cpu'); "
        "print(json.dumps([sorted(kept), sorted(os.sched_getaffinity(0))]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True
    )
    kept, cores = json.loads(out.stdout)
    assert kept == []
    assert cores == sorted(os.sched_getaffinity(0))


@two_cores
def test_nothing_is_pinned_on_a_gpu_host() -> None:
    # A bound child on a GPU host is a NUMA-bound GPU worker, not vLLM's CPU compute threads.
    got = place("cuda", "compute")
    everything = sorted(os.sched_getaffinity(0))
    assert got["kept"] == []
    assert got["main"] == got["older_thread"] == got["newer_thread"] == everything
    assert got["engine_core"] == got["helper"] == everything
