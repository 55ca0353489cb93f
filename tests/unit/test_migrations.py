"""The Alembic migrations build exactly the schema the models describe."""

from __future__ import annotations

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from tests.helpers import Servers
from tests.helpers import database_name
from tests.helpers import recreate_database
from thinkbatch.db import migrate
from thinkbatch.models import Base


def test_upgrade_head_on_empty_database_matches_models(servers: Servers) -> None:
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
        triggers = set(
            conn.execute(sa.text("SELECT tgname FROM pg_trigger WHERE NOT tgisinternal")).scalars()
        )
    engine.dispose()
    assert diff == []
    assert {
        "tb_items_counts_insert",
        "tb_items_counts_update",
        "tb_results_usage_insert",
    } <= triggers


def test_downgrade_to_base_and_back(servers: Servers) -> None:
    url = recreate_database(servers.postgres_admin_url, database_name("migrations"))
    migrate(url)
    migrate(url, "base", down=True)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        assert set(sa.inspect(conn).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    migrate(url)  # and up again from scratch
