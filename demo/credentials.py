"""Credentials the demo makes for itself: an API key for its tenant, and Flower's basic auth.

Nothing secret is tracked in the repository: Flower's password is generated at the first start
and kept under DATA_DIR (mode 0600); the API key is a fresh one per run, printed for the user.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from thinkbatch.keys import issue_key

DEMO_TENANT = "demo"


def demo_api_key(database_url: str) -> str:
    return issue_key(database_url, DEMO_TENANT, "make demo")


def flower_basic_auth(data_dir: Path) -> str:
    """`admin:<password>`, generated once and reused by later runs."""
    path = data_dir / "flower-basic-auth"
    if path.exists():
        return path.read_text().strip()
    data_dir.mkdir(parents=True, exist_ok=True)
    value = f"admin:{secrets.token_urlsafe(18)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(value + "\n")
    return value
