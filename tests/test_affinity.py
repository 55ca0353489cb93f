"""The worker keeps itself off the cores vLLM's compute threads are bound to, and puts vLLM's
engine core beside them unless told to keep it on the reserved cores (CPU hosts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from devstack.stack import ROOT

# Run in a child: pinning the pytest process itself would slow every later test.
SCRIPT = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    from worker.affinity import keep_off_compute_cores

    sleeper = [sys.executable, "-c", "import time; time.sleep(30)"]
    everything = sorted(os.sched_getaffinity(0))
    # Stand-ins for vLLM's processes: one bound to the first core (its compute threads), one
    # left unbound (its engine core).
    bound = subprocess.Popen(["taskset", "-c", str(everything[0]), *sleeper])
    unbound = subprocess.Popen(sleeper)
    time.sleep(0.5)
    before = threading.Thread(target=time.sleep, args=(5,), daemon=True)
    before.start()
    kept = keep_off_compute_cores(sys.argv[1], *sys.argv[2:])
    seen = {}
    after = threading.Thread(target=lambda: seen.update(core=sorted(os.sched_getaffinity(0))))
    after.start(); after.join()
    print(json.dumps({
        "kept": sorted(kept),
        "main": sorted(os.sched_getaffinity(0)),
        "older_thread": sorted(os.sched_getaffinity(before.native_id)),
        "newer_thread": seen["core"],
        "bound": sorted(os.sched_getaffinity(bound.pid)),
        "unbound": sorted(os.sched_getaffinity(unbound.pid)),
    }))
    bound.kill(); unbound.kill()
    """
)


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two or more cores and Linux affinity calls",
)
def test_worker_keeps_off_the_bound_cores_and_the_engine_core_joins_them() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "cpu"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    everything = sorted(os.sched_getaffinity(0))
    rest = everything[1:]
    assert got["kept"] == rest
    # Every thread of the worker, those started before and after.
    assert got["main"] == got["older_thread"] == got["newer_thread"] == rest
    # The unbound child (vLLM's engine core) polls while the model computes: beside the
    # compute threads, not on the cores the worker needs.
    assert got["unbound"] == everything[:1]
    assert got["bound"] == everything[:1]  # vLLM's own binding is left as it was


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two or more cores and Linux affinity calls",
)
def test_the_engine_core_can_stay_on_the_reserved_cores() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "cpu", "reserved"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(out.stdout)
    everything = sorted(os.sched_getaffinity(0))
    rest = everything[1:]
    assert got["kept"] == rest
    assert got["main"] == got["newer_thread"] == got["unbound"] == rest
    assert got["bound"] == everything[:1]


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


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two or more cores and Linux affinity calls",
)
def test_nothing_is_pinned_on_a_gpu_host() -> None:
    # A bound child on a GPU host is a NUMA-bound GPU worker, not vLLM's CPU compute threads.
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "cuda"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    everything = sorted(os.sched_getaffinity(0))
    assert got["kept"] == []
    assert got["main"] == got["older_thread"] == got["newer_thread"] == got["unbound"] == everything
