"""Print the README's settings table, or with --env a .env.example, from the Settings model
(the one source of truth)."""

from __future__ import annotations

import json
import sys

from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings


def table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "(unset)" if default is None else f"`{default}`"
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


# The variables docker-compose.yml reads for itself, not thinkbatch settings: the secrets it
# refuses to start without (`${NAME:?...}`: tests/unit/test_deploy.py checks this list against the
# file) and what else it passes on. None has a default: .env.example shows each commented out,
# with no value.
COMPOSE_VARIABLES = {
    "POSTGRES_PASSWORD": "Required. Password of compose's PostgreSQL user `thinkbatch`; it goes "
    "into THINKBATCH_DATABASE_URL, so make it URL-safe: "
    "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'",
    "REDIS_PASSWORD": "Required. Password of compose's Redis (requirepass); it goes into "
    "THINKBATCH_REDIS_URL, so make it URL-safe, as above.",
    "FLOWER_BASIC_AUTH": "Required. user:password of Flower's basic auth (127.0.0.1:5555); "
    "Flower's API can revoke tasks and stop workers.",
    "HF_TOKEN": "Hugging Face access token, read by the worker's model download: needed for "
    "gated or private models and against the Hub's rate limits for anonymous downloads; "
    "public models (Qwen3) download without it.",
    "API_PUBLISH": "Where compose publishes the API (address:port). Unset: 127.0.0.1:8000; "
    "e.g. 0.0.0.0:8000 behind a TLS proxy or firewall.",
}


def env_example() -> str:
    lines = ["# thinkbatch settings: every variable with its default (see README, Settings)."]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        lines.append(f"# {field.description or ''}")
        value = "" if default is None else default
        if isinstance(value, dict):
            value = json.dumps(value)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        prefix = "# " if default is None or extra.get("env_example") == "commented" else ""
        lines.append(f"{prefix}{ENV_PREFIX}{name.upper()}={value}")
    lines += ["", "# docker compose (docker-compose.yml): its secrets and what it passes on."]
    for name, description in COMPOSE_VARIABLES.items():
        lines += [f"# {description}", f"# {name}="]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # env_example() already ends in a newline; print() would add a second one.
    sys.stdout.write(env_example() if "--env" in sys.argv else table() + "\n")
