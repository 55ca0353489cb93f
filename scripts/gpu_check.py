"""`make gpu-check`: prove on a GPU host that thinkbatch runs there, in one command.

From a checkout (`make gpu-check`):
1. checks that this Python can build the venv (>= 3.11, with venv), and says how to get one;
2. reports the NVIDIA driver, the CUDA version it supports and the GPUs, and checks that the
   driver can run the pinned CUDA build;
3. checks what vLLM compiles with when its engine starts: gcc (Triton's launcher), the Python
   headers, and nvcc (FlashInfer's sampler), found as FlashInfer finds it and of the CUDA
   release torch is built for;
4. starts the real stack (PostgreSQL, Redis, API, one worker) with THINKBATCH_MODEL (default
   Qwen/Qwen3-0.6B, a small first download);
5. runs a 64-item job with thinking on, one with thinking off, and one with a thinking budget
   of half the first job's median thinking (on a GPU the engine enforces it in a kernel of its
   own) through the API, and checks each;
6. times the job system against the raw engine on the same GPU (one after the other) and prints
   items/s and tokens/s, then one PASS or FAIL line.

Against a running compose deployment (`make gpu-check-compose`, or `--compose`): step 2, then
step 5 against its API. The images hold the compilers, and the GPU is the compose worker's, so
steps 1, 3, 4 and 6 are not run; only the standard library is used, so any python3 runs it.
`--no-driver` skips step 2 too, for a deployment whose GPUs are elsewhere (Kubernetes).

Steps 1-3 use only the standard library (`--preflight` stops after them), so that a host
without a GPU, or with an unsuitable Python, is told so before anything is installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.parse
import urllib.request
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
# The budget job allows each item half the thinking tokens the thinking-on job's median item
# used, so that the engine has to close the thinking block of most items itself (a bound no
# item reaches would prove nothing); this when that job gave no figures.
THINKING_BUDGET = 32
COMPOSE_URL = "http://127.0.0.1:8000"
# A compose worker's first start downloads the model and compiles kernels: wait this long for
# a worker, and as long again for each job, before giving up.
COMPOSE_TIMEOUT_S = 3600.0
FINISHED = ("completed", "failed", "cancelled", "expired")


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


# --- nvcc, as FlashInfer finds it ------------------------------------------------------------


def cuda_home(env: dict[str, str] | None = None) -> str | None:
    """The CUDA toolkit FlashInfer compiles with (flashinfer.jit.cpp_ext.get_cuda_path):
    CUDA_HOME, else CUDA_PATH, else the parent of the nvcc on PATH, else /usr/local/cuda.
    A CUDA_HOME is taken as it is: FlashInfer never looks past it, even if it holds no nvcc."""
    env = dict(os.environ if env is None else env)
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home:
        return home
    found = shutil.which("nvcc", path=env.get("PATH"))
    if found:
        return str(Path(found).parent.parent)
    default = Path("/usr/local/cuda")
    return str(default) if default.exists() else None


def find_nvcc(env: dict[str, str] | None = None) -> str | None:
    """`$CUDA_HOME/bin/nvcc` of that toolkit, the compiler FlashInfer runs; None if absent."""
    home = cuda_home(env)
    if home is None:
        return None
    nvcc = Path(home) / "bin" / "nvcc"
    return str(nvcc) if nvcc.exists() else None


def parse_nvcc_release(version_text: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    match = re.search(r"release (\d+)\.(\d+),", version_text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def nvcc_release(nvcc: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return parse_nvcc_release(out.stdout)


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
    cuda = _install_module().GPU_CUDA_MAJOR
    home = cuda_home(env)
    nvcc = find_nvcc(env)
    if home is None:
        problems.append(
            "no nvcc (CUDA toolkit): vLLM's FlashInfer sampler compiles with it while the "
            f"engine warms up (use a CUDA devel image, or install the CUDA {cuda} toolkit and "
            "set CUDA_HOME to it)"
        )
    elif nvcc is None:
        problems.append(
            f"no nvcc at {Path(home) / 'bin' / 'nvcc'}: FlashInfer compiles with "
            "$CUDA_HOME/bin/nvcc (CUDA_HOME, else CUDA_PATH, else the nvcc on PATH) and looks "
            f"nowhere else; point CUDA_HOME at the CUDA {cuda} toolkit"
        )
    else:
        release = nvcc_release(nvcc)
        if release is None:
            problems.append(f"{nvcc} --version did not say its release")
        elif release[0] != cuda:
            problems.append(
                f"{nvcc} is CUDA {release[0]}.{release[1]}, but torch is built for CUDA {cuda}: "
                f"FlashInfer's kernels must be compiled by the same major release (install the "
                f"CUDA {cuda} toolkit and set CUDA_HOME to it)"
            )
    return problems


# --- steps 1-3 --------------------------------------------------------------------------------


def python_problem() -> str | None:
    """Step 1: can this Python build .venv (install.py's own check)."""
    problem: str | None = _install_module().python_problem()
    return problem


def driver_check() -> int:
    """Step 2. 0: go on; 2: no GPU here; 1: the driver cannot run the pinned build."""
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
    problem = install.check_driver(install.driver_version(driver))
    print(f"driver for CUDA {install.GPU_CUDA_MAJOR}: {problem or 'ok'}")
    return 1 if problem else 0


def preflight() -> int:
    """Steps 1-3. 0: go on; 2: no GPU here; 1: this host cannot run the pinned build."""
    problem = python_problem()
    if problem:
        print(f"gpu-check: {problem}")
        return 1
    code = driver_check()
    if code == 2:
        return code
    problems = toolchain_problems()
    nvcc = find_nvcc()
    release = nvcc_release(nvcc) if nvcc else None
    shown = f"{nvcc} (release {release[0]}.{release[1]})" if nvcc and release else "missing"
    gcc = "ok" if shutil.which("gcc") or shutil.which("cc") else "missing"
    print(f"compilers: gcc {gcc}, nvcc {shown}")
    for problem in problems:
        print(f"  missing: {problem}")
    return 1 if code or problems else 0


# --- the jobs (step 5), through the API with the standard library alone ----------------------


class ApiError(Exception):
    pass


class Api:
    """A JSON client of the thinkbatch API (urllib: the compose mode installs nothing)."""

    def __init__(self, base_url: str, key: str | None, timeout: float = 300):
        if urllib.parse.urlsplit(base_url).scheme not in ("http", "https"):
            raise ApiError(f"{base_url}: the API's URL must be http:// or https://")
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.timeout = timeout

    def call(
        self, method: str, path: str, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        url = self.base_url + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        data = None if body is None else json.dumps(body).encode()
        # An http(s) URL (checked in __init__), given by the user: the API under test.
        request = urllib.request.Request(url, data=data, headers=headers, method=method)  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # noqa: S310
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode(errors="replace")
            raise ApiError(f"{method} {path}: HTTP {error.code} {detail}") from None
        except (urllib.error.URLError, OSError) as error:
            raise ApiError(f"{method} {url}: {error}") from None


def sum_items(n: int = ITEMS) -> list[dict[str, Any]]:
    return [
        {"custom_id": f"t{k}", "messages": [{"role": "user", "content": f"What is {k} + {k + 7}?"}]}
        for k in range(n)
    ]


def run_job(
    api: Api, params: dict[str, Any], timeout: float | None = None, say: Any = print
) -> dict[str, Any]:
    """A 64-item job through the API; returns the finished job and its items."""
    body = {"items": sum_items(), "params": params}
    job = api.call("POST", "/v1/jobs", body)
    started = last = time.monotonic()
    while job["status"] not in FINISHED:
        if timeout is not None and time.monotonic() - started > timeout:
            raise ApiError(f"job {job['id']} is still {job['status']} after {timeout:.0f} s")
        if time.monotonic() - last >= 30:
            c = job["counts"]
            say(f"  job {job['id']}: {job['status']}, {c['succeeded']}/{c['total']} done")
            last = time.monotonic()
        time.sleep(1)
        job = api.call("GET", f"/v1/jobs/{job['id']}")
    listed = api.call("GET", f"/v1/jobs/{job['id']}/items", params={"limit": ITEMS})["data"]
    return {"job": job, "items": listed}


def _not_completed(result: dict[str, Any]) -> str | None:
    job = result["job"]
    if job["status"] != "completed" or job["counts"]["succeeded"] != ITEMS:
        return f"job {job['id']} ended {job['status']} with counts {job['counts']}"
    return None


def judge_thinking(result: dict[str, Any], enable: bool) -> str | None:
    """None when the job did what thinking on/off asks, else what went wrong."""
    failed = _not_completed(result)
    if failed:
        return failed
    with_thinking = sum(1 for item in result["items"] if item["thinking"])
    if enable and with_thinking < ITEMS // 2:
        return f"thinking on, but only {with_thinking} of {ITEMS} items have thinking"
    if not enable and with_thinking:
        return f"thinking off, but {with_thinking} items have thinking"
    return None


def judge_budget(result: dict[str, Any], budget: int) -> str | None:
    """None when the engine held every item to the thinking budget and most reached it.

    usage.reasoning_tokens counts the <think> the model writes and the </think> the engine
    forces, so a budget of B allows at most B + 1 (thinkbatch/limits.py). A bound that no item
    reached proves nothing, and an item the engine stopped must still answer after it."""
    failed = _not_completed(result)
    if failed:
        return failed
    items = result["items"]
    over = [i for i in items if i["usage"]["reasoning_tokens"] > budget + 1]
    if over:
        worst = max(i["usage"]["reasoning_tokens"] for i in over)
        return (
            f"thinking_budget {budget} not enforced: {len(over)} of {ITEMS} items thought "
            f"longer (up to {worst} reasoning tokens, at most {budget + 1} allowed)"
        )
    closed = [i for i in items if i["usage"]["reasoning_tokens"] == budget + 1]
    if len(closed) < ITEMS // 2:
        return (
            f"thinking_budget {budget}: only {len(closed)} of {ITEMS} items reached it, too few "
            "to show the engine closes the thinking"
        )
    unanswered = [i["custom_id"] for i in closed if not i["answer"]]
    if unanswered:
        return (
            f"thinking_budget {budget}: {len(unanswered)} items stopped by the budget have no "
            f"answer (e.g. {unanswered[0]})"
        )
    return None


def budget_below(result: dict[str, Any]) -> int:
    """A thinking budget most of the job's items would exceed: half its median thinking."""
    used = sorted(int(i["usage"]["reasoning_tokens"]) for i in result["items"] if i.get("usage"))
    if not used:
        return THINKING_BUDGET
    return max(2, used[len(used) // 2] // 2)


def run_jobs(api: Api, timeout: float | None = None) -> list[str]:
    """Step 5: thinking on, thinking off, and a thinking budget; the failures, if any."""
    failures: list[str] = []
    budget = THINKING_BUDGET
    for enable in (True, False):
        result = run_job(api, {"enable_thinking": enable, "max_tokens": 1024}, timeout)
        problem = judge_thinking(result, enable)
        print(f"{ITEMS}-item job, thinking {'on' if enable else 'off'}: {problem or 'ok'}",
              flush=True)  # fmt: skip
        if problem:
            failures.append(problem)
        if enable:
            budget = budget_below(result)
    params = {"enable_thinking": True, "thinking_budget": budget, "max_tokens": 1024}
    problem = judge_budget(run_job(api, params, timeout), budget)
    print(f"{ITEMS}-item job, thinking_budget {budget}: {problem or 'ok'}", flush=True)
    if problem:
        failures.append(problem)
    return failures


# --- from a checkout: steps 4-6 ----------------------------------------------------------------


def missing_checkout_parts() -> list[str]:
    """The parts of a checkout steps 4-6 run on; the images ship none of them."""
    return [name for name in ("bench", "devstack") if not (ROOT / name).is_dir()]


def run_stack_checks(model: str, max_tokens: int) -> int:
    """Steps 4-6 (needs the installed venv)."""
    import tempfile

    import httpx
    import sqlalchemy as sa

    from bench.raw_arm import RawArm
    from bench.system_arm import system_round
    from devstack import local_stack
    from devstack.stack import readiness_wait
    from thinkbatch.keys import issue_key

    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-gpu-check-"))
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
            base_url = f"http://127.0.0.1:{api.port}"
            failures = run_jobs(Api(base_url, key))
            with httpx.Client(
                base_url=base_url, timeout=300, headers={"Authorization": f"Bearer {key}"}
            ) as client:
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


# --- against a running compose deployment ------------------------------------------------------


def compose_key() -> str:
    """A fresh key of the tenant gpu-check, made in the compose API's container."""
    docker = shutil.which("docker")
    if docker is None:
        raise ApiError(
            "no API key: pass --api-key (or THINKBATCH_API_KEY); docker is not here to make one"
        )
    command = [docker, "compose", "exec", "-T", "api", "python", "-m", "thinkbatch.keys",
               "create", "--tenant", "gpu-check", "--name", "make gpu-check"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = out.stdout.split()
    if out.returncode != 0 or not lines:
        raise ApiError(f"could not make an API key ({' '.join(command[1:])}): {out.stderr.strip()}")
    return lines[-1]


def wait_for_worker(api: Api, timeout: float) -> list[str]:
    """The models of live workers, once there is one (a first start downloads the model)."""
    started = last = time.monotonic()
    while True:
        models = [m["id"] for m in api.call("GET", "/v1/models")["data"]]
        if models:
            return models
        if time.monotonic() - started > timeout:
            raise ApiError(f"no worker came up within {timeout:.0f} s (docker compose logs worker)")
        if time.monotonic() - last >= 30:
            print("  waiting for a worker to load its model (docker compose logs -f worker)")
            last = time.monotonic()
        time.sleep(5)


def run_compose_checks(url: str, key: str | None, timeout: float = COMPOSE_TIMEOUT_S) -> int:
    """Step 5 against a running deployment's API."""
    try:
        Api(url, None, timeout=10).call("GET", "/readyz")
        api = Api(url, key or compose_key())
        models = wait_for_worker(api, timeout)
        print(f"API {url}: ready; live workers serve {', '.join(models)}", flush=True)
        failures = run_jobs(api, timeout)
    except ApiError as error:
        print(f"gpu-check: FAIL: {error}")
        return 1
    print("(the raw-engine comparison needs the GPU to itself: run make gpu-check from a checkout)")
    print(f"gpu-check: {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}")
    return 0 if not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preflight", action="store_true", help="only steps 1-3 (no venv)")
    parser.add_argument("--model", default=os.environ.get("THINKBATCH_MODEL", DEFAULT_MODEL))
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument(
        "--compose", action="store_true", help="check a running deployment's API instead"
    )
    parser.add_argument("--url", default=os.environ.get("THINKBATCH_URL", COMPOSE_URL))
    parser.add_argument(
        "--api-key",
        default=os.environ.get("THINKBATCH_API_KEY"),
        help="with --compose; unset: one is made with docker compose exec api",
    )
    parser.add_argument(
        "--no-driver",
        action="store_true",
        help="with --compose: skip the driver check, for a deployment whose GPUs are on other "
        "machines (Kubernetes: run it against a port-forwarded API)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=COMPOSE_TIMEOUT_S,
        help="with --compose: seconds to wait for a worker, and for each job",
    )
    args = parser.parse_args(argv)
    if args.compose:
        code = 0 if args.no_driver else driver_check()
        if code:
            if code == 1:
                print("gpu-check: FAIL (fix the above, then run it again)")
            return code
        return run_compose_checks(args.url, args.api_key, args.timeout)
    code = preflight()
    if code or args.preflight:
        if code == 1:
            print("gpu-check: FAIL (fix the above, then run it again)")
        return code
    missing = missing_checkout_parts()
    if missing:
        print(f"gpu-check: this copy of thinkbatch has no {' or '.join(missing)}/ (an image ships "
              "neither): check a running deployment with --compose instead")  # fmt: skip
        return 1
    return run_stack_checks(args.model, args.max_tokens)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
