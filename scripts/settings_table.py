"""Print the README's settings table from the Settings model (the one source of truth)."""

from __future__ import annotations

from thinkbatch.settings import Settings


def table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        default = field.get_default(call_default_factory=True)
        shown = "(unset)" if default is None else f"`{default}`"
        rows.append(f"| `{name.upper()}` | {shown} | {field.description or ''} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
