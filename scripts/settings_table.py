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
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # env_example() already ends in a newline; print() would add a second one.
    sys.stdout.write(env_example() if "--env" in sys.argv else table() + "\n")
