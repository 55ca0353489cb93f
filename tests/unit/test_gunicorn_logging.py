"""The API's gunicorn settings (api/gunicorn.conf.py), loaded as gunicorn loads them: its own
lines go through the JSON formatter, and it builds no access line of its own, which the app
writes instead (api/access_log.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gunicorn.app.base import Application
from gunicorn.glogging import Logger

from thinkbatch.settings import get_settings

CONF = Path(__file__).resolve().parents[2] / "api" / "gunicorn.conf.py"


class _Loaded(Application):  # gunicorn's own loading of a config file, with no app to run
    def init(self, *_: Any) -> None:
        return None

    def load(self) -> None:
        return None

    def load_config(self) -> None:
        self.load_config_from_file(str(CONF))


def test_gunicorn_builds_no_access_line_the_app_writes_its_own(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The file sets up the API's metrics directory as it loads: here a temporary one, and
    # the variable it sets for prometheus-client is put back after the test.
    monkeypatch.setenv("THINKBATCH_PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    monkeypatch.setattr("sys.argv", ["gunicorn"])
    get_settings.cache_clear()
    try:
        cfg = _Loaded().cfg
    finally:
        get_settings.cache_clear()
    assert cfg.accesslog is None and cfg.logconfig_dict  # the JSON formatter's settings
    log = cfg.logger_class(cfg)
    assert isinstance(log, Logger)
    assert not log.access_log_enabled

    def built(*_: Any) -> dict[str, str]:
        raise AssertionError("gunicorn built an access line")

    monkeypatch.setattr(log, "atoms", built)
    log.access(None, None, {}, None)  # returns before it builds anything
