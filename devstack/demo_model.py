"""The tiny demo model for the demo, the benchmark and the tests.

The worker knows nothing of it: it serves whatever THINKBATCH_MODEL names. The dev stack builds
the checkpoint (devstack/tiny_model.py, once; cached) and hands its directory to the worker as
the model, under the served name `thinkbatch-demo` that jobs ask for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings

DEMO_MODEL = "thinkbatch-demo"
ROOT = Path(__file__).resolve().parent.parent


def wants_demo_model(settings: Settings) -> bool:
    """The demo model unless the environment or .env names another model (the settings' own
    default is the production model, never the toy one). Naming `thinkbatch-demo` asks for it."""
    return "model" not in settings.model_fields_set or settings.model == DEMO_MODEL


def build_demo_model(env: Mapping[str, str] | None = None) -> Path:
    """Build the demo checkpoint unless an up-to-date one is cached; return its directory.
    Built in a child process: training loads torch, which the launcher has no use for."""
    from devstack.tiny_model import (
        DEFAULT_DIR,  # devstack/tiny_model.py imports only the stdlib at the top
    )

    subprocess.run(
        [sys.executable, "-m", "devstack.tiny_model", "--out", str(DEFAULT_DIR)],
        cwd=ROOT,
        env=None if env is None else dict(env),
        check=True,
        stdout=subprocess.DEVNULL,  # its CLI prints the directory, which is returned here
    )
    return Path(DEFAULT_DIR).resolve()


def demo_model_env(path: Path) -> dict[str, str]:
    """The settings that serve the checkpoint at `path` as `thinkbatch-demo` (worker and API:
    the API checks the model a job names against the served name)."""
    return {f"{ENV_PREFIX}MODEL": str(path), f"{ENV_PREFIX}SERVED_MODEL_NAME": DEMO_MODEL}


def build_demo_adapter(env: Mapping[str, str] | None = None) -> tuple[str, Path]:
    """Build the demo model's LoRA adapter (devstack/tiny_lora.py: peft, seconds; cached, and
    the demo model first if need be); return its served name and directory."""
    from devstack.tiny_lora import ADAPTER_NAME
    from devstack.tiny_lora import DEFAULT_DIR

    subprocess.run(
        [sys.executable, "-m", "devstack.tiny_lora", "--out", str(DEFAULT_DIR)],
        cwd=ROOT,
        env=None if env is None else dict(env),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return ADAPTER_NAME, Path(DEFAULT_DIR).resolve()


def demo_adapter_env(name: str, path: Path) -> dict[str, str]:
    """The setting that serves the adapter at `path` as `name` beside the demo model."""
    return {f"{ENV_PREFIX}LORA_ADAPTERS": json.dumps({name: str(path)})}
