"""docs/settings.md documents every setting, the README every bound on what a request may
cost, and .env.example matches the settings model; the README stays a user's page."""

from __future__ import annotations

from tests.helpers import ROOT
from tests.helpers import load_script
from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings


def test_the_settings_reference_lists_every_setting() -> None:
    reference = (ROOT / "docs" / "settings.md").read_text()
    names = [f"{ENV_PREFIX}{n.upper()}" for n in Settings.model_fields]
    assert [name for name in names if f"`{name}`" not in reference] == []
    assert load_script("settings_table").table() in reference


def test_the_readme_states_every_bound_with_its_default() -> None:
    script = load_script("settings_table")
    assert set(script.BOUNDS) <= set(Settings.model_fields)
    assert script.bounds() in (ROOT / "README.md").read_text()


def test_the_readme_states_what_each_reasoning_effort_means() -> None:
    assert load_script("settings_table").efforts() in (ROOT / "README.md").read_text()


def test_the_request_reference_names_every_params_field() -> None:
    from thinkbatch.jobs.wire import SamplingParamsIn

    reference = (ROOT / "docs" / "requests.md").read_text()
    assert [n for n in SamplingParamsIn.model_fields if f"`{n}`" not in reference] == []


def test_the_readme_is_a_users_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 500
    for narration in ("Stop 1", "Stop 2", "issue 1", "the host before", "previous host"):
        assert narration not in readme


def test_env_example_is_current() -> None:
    assert (ROOT / ".env.example").read_text() == load_script("settings_table").env_example()
