"""The README documents every setting, and .env.example matches the settings model."""

from __future__ import annotations

import importlib.util

from tests.helpers import ROOT
from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings


def _script():
    spec = importlib.util.spec_from_file_location(
        "settings_table", ROOT / "scripts/settings_table.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_lists_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    names = [f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields]
    missing = [name for name in names if f"`{name}`" not in readme]
    assert missing == []
    assert _script().table() in readme


def test_env_example_is_current() -> None:
    assert (ROOT / ".env.example").read_text() == _script().env_example()
