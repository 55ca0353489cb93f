"""Wait until the database's schema is the one this code was built for.

`python -m thinkbatch.schema_ready` exits 0 once the database (THINKBATCH_DATABASE_URL) stands at
the head revision of the migrations shipped beside this code, and waits while it does not: while
Postgres does not answer yet, or the migration Job has not run, or is still running. The API's
and the workers' pods in deploy/k8s run it as their init container, so that none of them starts
on an older schema. It only reads: the migration Job alone writes the schema.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import sqlalchemy as sa
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from thinkbatch.db import make_engine
from thinkbatch.settings import Settings


def migrations_dir(roots: Sequence[Path] | None = None) -> Path:
    """The migrations beside this code: the checkout's, or /app's in the images (their working
    directory, where they copy migrations/; the installed package holds none)."""
    if roots is None:
        roots = (Path(__file__).resolve().parent.parent, Path.cwd())
    for root in roots:
        if (root / "migrations" / "env.py").exists():
            return root / "migrations"
    raise FileNotFoundError("no migrations/ beside thinkbatch nor in the working directory")


def head_revisions(directory: Path | None = None) -> set[str]:
    return set(ScriptDirectory(str(directory or migrations_dir())).get_heads())


def current_revisions(engine: sa.Engine) -> set[str]:
    with engine.connect() as conn:
        return set(MigrationContext.configure(conn).get_current_heads())


def status(engine: sa.Engine, heads: set[str]) -> str | None:
    """None when the database is at `heads`, else why not (for the log)."""
    try:
        current = current_revisions(engine)
    except sa.exc.OperationalError as error:
        return f"the database does not answer yet ({type(error.orig).__name__})"
    if current == heads:
        return None
    shown = ", ".join(sorted(current)) or "no schema"
    return f"the database is at {shown}, this code needs {', '.join(sorted(heads))}"


def wait(engine: sa.Engine, *, timeout: float | None, interval: float = 2.0) -> bool:
    heads = head_revisions()
    started = time.monotonic()
    said = ""
    while True:
        why = status(engine, heads)
        if why is None:
            print(f"schema at {', '.join(sorted(heads))}: ready", flush=True)
            return True
        if why != said:  # one line per change, not one per poll
            print(f"waiting for the migration: {why}", flush=True)
            said = why
        left = None if timeout is None else timeout - (time.monotonic() - started)
        if left is not None and left <= 0:
            return False
        time.sleep(interval if left is None else min(interval, left))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=None, help="seconds (default: forever)")
    args = parser.parse_args(argv)
    engine = make_engine(Settings(), pool_size=1, max_overflow=0)
    try:
        return 0 if wait(engine, timeout=args.timeout) else 1
    finally:
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
