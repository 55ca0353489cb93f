"""`thinkbatch keys create|list|revoke`: API keys, administered against the database itself
(they are what the API checks, so they cannot be made through it).

The database is `--database-url` or THINKBATCH_DATABASE_URL (a `.env` file is read too, as by
the API and the worker). `make demo` prints the command with its embedded database's URL.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer
from sqlalchemy import orm

from thinkbatch import keys
from thinkbatch.db import make_engine
from thinkbatch.settings import Settings
from thinkbatch.settings import get_settings

app = typer.Typer(
    no_args_is_help=True,
    help="Manage API keys: create, list and revoke (against the database directly).",
)

DatabaseUrl = Annotated[
    str | None,
    typer.Option(
        "--database-url",
        envvar="THINKBATCH_DATABASE_URL",
        help="PostgreSQL URL of the deployment (default: THINKBATCH_DATABASE_URL or .env).",
        show_envvar=True,
    ),
]


class KeysError(Exception):
    """Reported as one line on stderr, exit code 1 (thinkbatch/cli/main.py)."""


@contextmanager
def _sessions(database_url: str | None) -> Iterator[orm.sessionmaker[orm.Session]]:
    settings = get_settings()
    if database_url:
        settings = Settings.model_validate({**settings.model_dump(), "database_url": database_url})
    if settings.database_url is None:
        raise KeysError("no database: give --database-url or set THINKBATCH_DATABASE_URL")
    engine = make_engine(settings, pool_size=1, max_overflow=0)
    try:
        yield orm.sessionmaker(engine)
    finally:
        engine.dispose()  # a command may run in a process that lives on (tests' CliRunner)


@app.command()
def create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    name: Annotated[str, typer.Option(help="What the key is for.")] = "",
    database_url: DatabaseUrl = None,
) -> None:
    """Create a key for TENANT and print it (it is shown only this once)."""
    with _sessions(database_url) as sessions, sessions.begin() as session:
        try:
            key, info = keys.create_key(session, tenant, name)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--tenant") from None
    typer.echo(key)
    typer.echo(f"prefix {info.prefix}, tenant {info.tenant}", err=True)


@app.command(name="list")
def list_(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
    include_revoked: Annotated[bool, typer.Option("--all", help="Include revoked keys.")] = False,
    database_url: DatabaseUrl = None,
) -> None:
    """List keys by prefix (never the keys themselves)."""
    with _sessions(database_url) as sessions, sessions() as session:
        for info in keys.list_keys(session, tenant, include_revoked=include_revoked):
            revoked = f"  revoked {info.revoked_at:%Y-%m-%d %H:%M}" if info.revoked_at else ""
            typer.echo(
                f"{info.prefix}  {info.tenant:<20} {info.created_at:%Y-%m-%d %H:%M}  "
                f"{info.name}{revoked}"
            )


@app.command()
def revoke(
    prefix: Annotated[str, typer.Argument(help="The key's prefix, as `list` shows it.")],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke the key with PREFIX; it stops working on the next request."""
    with _sessions(database_url) as sessions, sessions.begin() as session:
        info = keys.revoke_key(session, prefix)
    if info is None:
        raise KeysError(f"no key with prefix {prefix!r}")
    typer.echo(f"revoked {info.prefix} ({info.tenant})")
