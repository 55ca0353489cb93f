"""`make gpu-check`: prove on a GPU host that thinkbatch runs there, in one command.

1. reports the NVIDIA driver, the CUDA version it supports and the GPUs;
2. checks what vLLM compiles with when its engine starts: gcc (Triton's launcher), the Python
   headers, and nvcc (FlashInfer's sampler) — and that the driver can run the pinned CUDA build;
3. starts the real stack (PostgreSQL, Redis, API, one worker) with THINKBATCH_MODEL (default
   Qwen/Qwen3-0.6B, a small first download);
4. runs a 64-item job with thinking on and one with thinking off through the API;
5. times the job system against the raw engine on the same GPU (one after the other) and prints
   items/s and tokens/s, then one PASS or FAIL line.

Steps 1-2 use only the standard library (`--preflight` stops after them), so that a host
without a GPU is told so before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
ITEMS = 64
# The job system must keep at least this share of the raw engine's items/s on 64 items (a
# small batch, where the fixed cost of a job weighs most).
MIN_RATIO = 0.5
GPU_QUERY = "index,name,driver_version,memory.total"


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    driver: str
    memory_mib: int


def _install_module() -> Any:
    spec = importlib.util.spec_from_file_location("thinkbatch_install", ROOT / "scripts/install.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def parse_gpus(csv: str) -> list[Gpu]:
    """GPUs from `nvidia-smi --query-gpu=index,name,driver_version,memory.total
    --format=csv,noheader,nounits`."""
    gpus = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 4 and parts[0].isdigit():
            gpus.append(Gpu(int(parts[0]), parts[1], parts[2], int(float(parts[3]))))
    return gpus


def parse_cuda_version(smi_banner: str) -> str | None:
    """The CUDA version the driver supports, from plain `nvidia-smi`'s banner."""
    match = re.search(r"CUDA Version:\s*([0-9]+\.[0-9]+)", smi_banner)
    return match.group(1) if match else None


def find_nvcc(env: dict[str, str] | None = None) -> str | None:
    """nvcc as FlashInfer finds it: $CUDA_HOME/bin, then PATH, then /usr/local/cuda."""
    env = dict(os.environ if env is None else env)
    for home in (env.get("CUDA_HOME"), env.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc", path=env.get("PATH"))
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def toolchain_problems(env: dict[str, str] | None = None) -> list[str]:
    """What vLLM will need to compile at start-up and is missing here (empty: all present)."""
    problems = []
    if not (shutil.which("gcc") or shutil.which("cc")):
        problems.append(
            "no C compiler (gcc): Triton builds its CUDA launcher with it on first use "
            "(apt-get install gcc)"
        )
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        problems.append(
            f"no Python headers ({headers}): Triton's launcher includes Python.h "
            "(apt-get install python3-dev, or python3.X-dev for this Python)"
        )
    if find_nvcc(env) is None:
        cuda = _install_module().GPU_CUDA_MAJOR
        problems.append(
            "no nvcc (CUDA toolkit): vLLM's FlashInfer sampler compiles with it while the "
            f"engine warms up (use a CUDA devel image, install the CUDA {cuda} toolkit, or set "
            "CUDA_HOME)"
        )
    return problems


def preflight() -> int:
    """Steps 1-2. 0: go on; 2: no GPU here; 1: the host cannot run the pinned build."""
    smi = shutil.which("nvidia-smi")
    query = [smi or "nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]
    listing = subprocess.run(query, capture_output=True, text=True) if smi else None
    if listing is None or listing.returncode != 0 or not parse_gpus(listing.stdout):
        why = "nvidia-smi is not installed" if smi is None else "nvidia-smi lists no GPU"
        print(f"gpu-check: no NVIDIA GPU found ({why}). Run it on a host with an NVIDIA GPU and")
        print("its driver; this machine can run the CPU demo instead (make demo).")
        return 2
    assert smi is not None  # a listing ran, so nvidia-smi is there
    gpus = parse_gpus(listing.stdout)
    banner = subprocess.run([smi], capture_output=True, text=True).stdout
    install = _install_module()
    driver = gpus[0].driver
    print(f"driver {driver}, CUDA {parse_cuda_version(banner) or '?'} (driver's maximum)")
    for gpu in gpus:
        print(f"  GPU {gpu.index}: {gpu.name}, {gpu.memory_mib / 1024:.1f} GiB")
    failed = False
    problem = install.check_driver(install.driver_version(driver))
    print(f"driver for CUDA {install.GPU_CUDA_MAJOR}: {problem or 'ok'}")
    failed |= problem is not None
    problems = toolchain_problems()
    nvcc = find_nvcc()
    print(f"compilers: gcc {'ok' if shutil.which('gcc') or shutil.which('cc') else 'missing'}, "
          f"nvcc {nvcc or 'missing'}")  # fmt: skip
    for problem in problems:
        print(f"  missing: {problem}")
    failed |= bool(problems)
    return 1 if failed else 0


def thinking_job(client: Any, enable: bool) -> dict[str, Any]:
    """A 64-item job through the API; returns the finished job and its items."""
    import time

    items = [
        {"custom_id": f"t{k}", "messages": [{"role": "user", "content": f"What is {k} + {k + 7}?"}]}
        for k in range(ITEMS)
    ]
    params = {"enable_thinking": enable, "max_tokens": 1024}
    job = client.post("/v1/jobs", json={"items": items, "params": params}).raise_for_status().json()
    while job["status"] in ("queued", "running", "cancelling"):
        time.sleep(1)
        job = client.get(f"/v1/jobs/{job['id']}").raise_for_status().json()
    listed = client.get(f"/v1/jobs/{job['id']}/items", params={"limit": ITEMS}).json()["data"]
    return {"job": job, "items": listed}


def judge_thinking(result: dict[str, Any], enable: bool) -> str | None:
    """None when the job did what thinking on/off asks, else what went wrong."""
    job, items = result["job"], result["items"]
    if job["status"] != "completed" or job["counts"]["succeeded"] != ITEMS:
        return f"job {job['id']} ended {job['status']} with counts {job['counts']}"
    with_thinking = sum(1 for item in items if item["thinking"])
    if enable and with_thinking < ITEMS // 2:
        return f"thinking on, but only {with_thinking} of {ITEMS} items have thinking"
    if not enable and with_thinking:
        return f"thinking off, but {with_thinking} items have thinking"
    return None


def run_stack_checks(model: str, max_tokens: int) -> int:
    """Steps 3-5 (needs the installed venv)."""
    import tempfile

    import httpx
    import sqlalchemy as sa

    from bench.raw_arm import RawArm
    from bench.system_arm import system_round
    from devstack import local_stack
    from devstack.stack import readiness_wait
    from thinkbatch.keys import issue_key

    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-gpu-check-"))
    failures: list[str] = []
    env = {"THINKBATCH_MODEL": model}
    with local_stack(tmp, env=env, database="gpucheck", engine=False, demo_model=False) as local:
        stack, settings, database_url = local.stack, local.settings, local.database_url
        try:
            print(f"starting the stack with THINKBATCH_MODEL={model} (logs: {stack.log_dir})",
                  flush=True)  # fmt: skip
            api = stack.start_api(workers=2)
            worker = stack.start_worker("worker", wait=False)
            stack.wait_worker_ready(
                worker, **readiness_wait(settings), on_status=lambda s: print(f"  worker: {s}")
            )
            key = issue_key(database_url, "gpu-check", "make gpu-check")
            with httpx.Client(
                base_url=f"http://127.0.0.1:{api.port}",
                timeout=300,
                headers={"Authorization": f"Bearer {key}"},
            ) as client:
                for enable in (True, False):
                    problem = judge_thinking(thinking_job(client, enable), enable)
                    word = "on" if enable else "off"
                    print(f"{ITEMS}-item job, thinking {word}: {problem or 'ok'}", flush=True)
                    if problem:
                        failures.append(problem)
                db = sa.create_engine(database_url)
                system = system_round(client, db, ITEMS, max_tokens, round_no=1)
                db.dispose()
        finally:
            stack.stop_all()  # frees the GPU before the raw engine loads
        raw_arm = RawArm(stack.env, ITEMS, max_tokens)
        try:
            raw_arm.wait_ready()
            raw = raw_arm.round(1, max_tokens)
        finally:
            raw_arm.close()
    print(f"{'arm':12} {'items/s':>9} {'out tok/s':>10}   ({ITEMS} items x {max_tokens} tokens)")
    for name, arm in (("raw engine", raw), ("job system", system)):
        secs = arm["seconds"]
        print(f"{name:12} {ITEMS / secs:9.1f} {arm['output_tokens'] / secs:10.0f}")
    ratio = raw["seconds"] / system["seconds"]
    print(f"ratio (job system / raw engine): {ratio:.2f} (pass: >= {MIN_RATIO})")
    if ratio < MIN_RATIO:
        failures.append(f"the job system reached {ratio:.2f} of the raw engine")
    print(f"gpu-check: {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}")
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preflight", action="store_true", help="only steps 1-2 (no venv)")
    parser.add_argument("--model", default=os.environ.get("THINKBATCH_MODEL", DEFAULT_MODEL))
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args(argv)
    code = preflight()
    if code or args.preflight:
        if code == 1:
            print("gpu-check: FAIL (fix the above, then run it again)")
        return code
    return run_stack_checks(args.model, args.max_tokens)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
