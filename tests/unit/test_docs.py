"""The README documents every setting, and .env.example matches the settings model."""

from __future__ import annotations

from tests.helpers import ROOT
from tests.helpers import load_script
from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings


def test_readme_lists_every_setting() -> None:
    readme = (ROOT / "README.md").read_text()
    names = [f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields]
    missing = [name for name in names if f"`{name}`" not in readme]
    assert missing == []
    assert load_script("settings_table").table() in readme


def test_env_example_is_current() -> None:
    assert (ROOT / ".env.example").read_text() == load_script("settings_table").env_example()
