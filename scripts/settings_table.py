"""From the Settings model (the one source of truth): docs/settings.md's table of every
setting (`python scripts/settings_table.py`), the README's table of the bounds on what a
request may cost (`--bounds`), the README's table of what each `reasoning_effort` means
(`--efforts`), and .env.example (`--env`)."""

from __future__ import annotations

import json
import sys

from thinkbatch.settings import ENV_PREFIX
from thinkbatch.settings import Settings

# The settings that bound what one request, one client or one tenant may cost the service:
# the README's security section states each with its default.
BOUNDS = (
    "max_request_bytes",
    "request_header_timeout_s",
    "request_read_timeout_s",
    "request_min_bytes_per_s",
    "max_uploads_per_client",
    "api_max_connections",
    "spool_memory_bytes",
    "response_spool_max_bytes",
    "response_write_timeout_s",
    "max_json_depth",
    "max_items_per_job",
    "max_prompt_chars",
    "max_messages_per_item",
    "max_item_chars",
    "max_item_values",
    "max_tokens_cap",
    "max_choices",
    "max_grammar_chars",
    "max_logprob_entries",
    "max_completion_window_s",
    "max_file_bytes",
    "max_batch_errors",
    "auth_failures_per_minute",
    "tenant_max_unfinished_items",
    "tenant_jobs_per_minute",
    "tenant_max_jobs_per_worker",
)


def table(names: tuple[str, ...] | None = None) -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        if names is not None and name not in names:
            continue
        default = field.get_default(call_default_factory=True)
        shown = "(unset)" if default is None else f"`{default}`"
        rows.append(f"| `{ENV_PREFIX}{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


def bounds() -> str:
    return table(BOUNDS)


def efforts() -> str:
    """What each `reasoning_effort` asks of the thinking, by default."""
    budgets = Settings.model_fields["reasoning_effort_budgets"].get_default(
        call_default_factory=True
    )
    rows = [
        "| reasoning_effort | thinking |",
        "|---|---|",
        "| `none` | off (enable_thinking false) |",
    ]
    for effort, budget in budgets.items():
        shown = "on, no budget" if budget is None else f"on, thinking_budget {budget}"
        rows.append(f"| `{effort}` | {shown} |")
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
    if "--env" in sys.argv:
        sys.stdout.write(env_example())
    else:
        print(bounds() if "--bounds" in sys.argv else efforts() if "--efforts" in sys.argv
              else table())  # fmt: skip
