"""The real vLLM engine's core process killed while requests run (an OOM kill, a crashed
driver): every request in flight ends with EngineDead within seconds, and so does every later
one, so that the worker hands its items back and restarts (worker.runner) instead of waiting on
an engine that is gone. The chaos suite kills whole workers; this kills the core alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.stack import ROOT
from tests.stacks import VLLM_ENV
from tests.stacks import build_demo_model

pytestmark = [pytest.mark.slow, pytest.mark.engine]

# Run in a process of its own: the engine, its core and the kill stay out of pytest's process.
# The result goes to a file named on the command line: stdout is shared with vLLM's own logging,
# whose shutdown line can land in the middle of a printed one.
SCRIPT = r"""
import asyncio, json, sys, time, uuid
import psutil
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import resolve_sampling
from thinkbatch.settings import get_settings
from worker.affinity import is_engine_core
from worker.engine import EngineDead
from worker.vllm_engine import VLLMEngine

async def main():
    engine = VLLMEngine(get_settings())
    await engine.start()
    items = [Claimed(k, uuid.uuid4(), k, f"c{k}", [{"role": "user", "content": f"q {k}"}],
                     None, None, 1, 0) for k in range(48)]
    params = resolve_sampling({"max_tokens": 400, "ignore_eos": True}, None,
                              default_max_tokens=400)
    prepared = engine.prepare(items, [params] * len(items))
    tasks = [asyncio.ensure_future(engine.generate(f"r{k}", p)) for k, p in enumerate(prepared)]
    await asyncio.sleep(1.0)  # running: the core is stepping them
    cores = [p for p in psutil.Process().children(recursive=True) if is_engine_core(p)]
    for core in cores:
        core.kill()
    killed = time.monotonic()
    done, pending = await asyncio.wait(tasks, timeout=30)
    ended = {}
    for task in done:
        error = task.exception()
        kind = type(error).__name__ if error is not None else "finished"
        ended[kind] = ended.get(kind, 0) + 1
    try:
        await engine.generate("later", prepared[0])
        later = "finished"
    except EngineDead:
        later = "EngineDead"
    with open(sys.argv[1], "w") as out:
        json.dump({
            "cores": len(cores), "ended": ended, "waiting": len(pending),
            "seconds": round(time.monotonic() - killed, 2), "later": later,
        }, out)

asyncio.run(main())
"""


def test_a_killed_engine_core_ends_every_request_in_flight_and_later(tmp_path: Path) -> None:
    build_demo_model()
    env = {**os.environ, **VLLM_ENV}
    out = tmp_path / "result.json"
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], env=env, cwd=ROOT, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert out.exists(), (run.stdout + run.stderr)[-3000:]
    result = json.loads(out.read_text())
    assert result["cores"] >= 1, result
    # Every request either finished before the kill or ended as EngineDead; none waits.
    assert result["waiting"] == 0, result
    assert set(result["ended"]) <= {"finished", "EngineDead"}, result
    assert result["ended"].get("EngineDead", 0) > 0, result
    assert result["seconds"] < 10, result
    assert result["later"] == "EngineDead", result
