"""Alembic environment: the URL comes from Settings (DATABASE_URL), the schema from the models."""

from __future__ import annotations

from alembic import context

from thinkbatch.db import make_engine
from thinkbatch.models import Base
from thinkbatch.settings import Settings

target_metadata = Base.metadata


def run_migrations_offline() -> None:
    context.configure(
        url=Settings().require_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    # Tests hand over their own connection; the CLI builds one from the environment.
    connection = context.config.attributes.get("connection")
    if connection is not None:
        context.configure(
            connection=connection, target_metadata=target_metadata, transaction_per_migration=True
        )
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(Settings())
    with engine.connect() as connection:
        # One transaction per migration: a migration that builds an index CONCURRENTLY commits
        # what came before it and runs outside a transaction (Alembic's autocommit_block).
        context.configure(
            connection=connection, target_metadata=target_metadata, transaction_per_migration=True
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
