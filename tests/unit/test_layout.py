"""What ships is thinkbatch/, api/ and worker/: none of them imports the demo, the benchmarks or
the dev stack, the wheel holds nothing else, and neither Docker image copies them."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.helpers import load_script

SHIPPED = ("thinkbatch", "api", "worker")
DEV_ONLY = ("demo", "bench", "devstack")


def _imported_modules(path: Path) -> list[str]:
    """Every module an `import` or `from ... import` in the file names, at any depth (a
    function-level import counts as much as a top-level one)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_shipped_code_never_imports_the_dev_packages() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in SHIPPED
        for path in sorted((ROOT / package).rglob("*.py"))
        for name in _imported_modules(path)
        if name.split(".")[0] in DEV_ONLY
    ]
    assert found == []


def test_the_import_check_sees_a_nested_import(tmp_path: Path) -> None:
    # The walk above must catch the kind of import the worker used to have.
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from demo.model import ensure_demo_model\n")
    assert _imported_modules(module) == ["demo.model"]


def test_docker_images_copy_no_dev_packages() -> None:
    copies = [
        line.split()[1].rstrip("/")
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    ]
    assert {"thinkbatch", "api", "worker"} <= set(copies)
    assert not set(copies) & set(DEV_ONLY), copies


def test_the_wheel_ships_only_thinkbatch_api_and_worker(tmp_path: Path) -> None:
    # Built from a fresh copy: setuptools reuses a build/ folder, whose stale files would count.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git",
            ".venv",
            ".ruff_cache",
            "build",
            "*.egg-info",
            "__pycache__",
            ".thinkbatch",
            "artifacts",
        ),  # fmt: skip
    )
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.fail(done.stdout + done.stderr)
    (wheel,) = (tmp_path / "dist").glob("thinkbatch-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(SHIPPED)


def test_no_import_runs_back_up_a_layer_and_none_is_circular() -> None:
    """scripts/structure.py's layers: the core, the ledger, the job service, its facades, the
    processes, the dev stack, the tools. A module imports its own layer and those below."""
    structure = load_script("structure")
    edges = structure.graph()
    assert structure.upward(edges) == []
    assert structure.cycles(edges) == []


def test_the_openai_facade_uses_only_what_the_job_service_exports() -> None:
    structure = load_script("structure")
    behind = [
        f"{module} -> {target}"
        for module, targets in structure.graph().items()
        if module.startswith("thinkbatch.openai")
        for target in targets
        if target.startswith("thinkbatch.jobs.")
    ]
    assert behind == []
