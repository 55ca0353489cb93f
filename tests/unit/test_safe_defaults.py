"""Safe defaults of what runs beside the API: the compose file takes every secret from `.env`,
publishes nothing but the API (on loopback) and Flower (on loopback, behind basic auth), and no
tracked file carries a default password."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import yaml

from tests.helpers import ROOT

REQUIRED = re.compile(r"\$\{(\w+):\?[^}]*\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_refuses_to_start_without_the_secrets() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    # `${NAME:?message}`: compose stops with the message when NAME is unset or empty.
    assert {"POSTGRES_PASSWORD", "REDIS_PASSWORD", "FLOWER_BASIC_AUTH"} <= set(
        REQUIRED.findall(text)
    )
    services = compose()["services"]
    assert REQUIRED.fullmatch(services["postgres"]["environment"]["POSTGRES_PASSWORD"])
    assert REQUIRED.fullmatch(services["flower"]["environment"]["FLOWER_BASIC_AUTH"])
    redis_cmd = services["redis"]["command"]
    assert REQUIRED.fullmatch(redis_cmd[redis_cmd.index("--requirepass") + 1])
    env = compose()["x-env"]
    assert "${POSTGRES_PASSWORD:?" in env["THINKBATCH_DATABASE_URL"]
    assert "${REDIS_PASSWORD:?" in env["THINKBATCH_REDIS_URL"]
    assert not any("--basic-auth" in part for part in services["flower"]["command"])


def test_only_the_api_and_flower_publish_ports_and_only_on_loopback() -> None:
    services = compose()["services"]
    published = {name: svc.get("ports", []) for name, svc in services.items() if svc.get("ports")}
    assert set(published) == {"api", "flower"}
    assert published["flower"] == ["127.0.0.1:5555:5555"]
    (api,) = published["api"]
    assert api.startswith("${API_PUBLISH:-127.0.0.1:")


def test_the_worker_and_api_accept_json_only() -> None:
    from thinkbatch.queue import make_celery
    from thinkbatch.settings import Settings

    conf = make_celery(Settings(redis_url="redis://127.0.0.1:1/0", _env_file=None)).conf
    assert conf.accept_content == ["json"] and conf.task_serializer == "json"


# Passwords that must never be defaults in a tracked file (compose once shipped admin:change-me).
DEFAULT_SECRETS = re.compile(
    r"change-me|changeme|admin:admin|password123|POSTGRES_PASSWORD:\s*[\w'\"]"
    r"|requirepass\s+\w|:thinkbatch@|FLOWER_BASIC_AUTH:-|REDIS_PASSWORD:-|POSTGRES_PASSWORD:-",
    re.IGNORECASE,
)


def test_no_default_passwords_in_tracked_files() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    assert len(files) > 20
    hits = []
    for name in files:
        if name.startswith("tests/"):
            continue  # the tests name them to look for them
        text = (ROOT / name).read_text(errors="replace")
        hits += [f"{name}: {m.group(0)}" for m in DEFAULT_SECRETS.finditer(text)]
    assert hits == []
