"""API keys: only a hash is stored, verification is exact, revocation is immediate."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy import orm
from typer.testing import CliRunner

from thinkbatch.cli.main import app
from thinkbatch.keys import create_key
from thinkbatch.keys import list_keys
from thinkbatch.keys import revoke_key
from thinkbatch.keys import verify_key
from thinkbatch.models import ApiKey
from thinkbatch.settings import Settings


def test_a_created_key_verifies_and_only_its_hash_is_stored(db: sa.Engine) -> None:
    with orm.Session(db) as session, session.begin():
        key, info = create_key(session, "acme", "ci")
    assert key.startswith(f"tb_{info.prefix}_")
    with orm.Session(db) as session:
        caller = verify_key(session, key)
        row = session.scalars(sa.select(ApiKey)).one()
    assert caller is not None and caller.tenant == "acme" and caller.key_prefix == info.prefix
    # The secret is all after the prefix: it is URL-safe base64, which may hold "_" too.
    secret = key.removeprefix(f"tb_{info.prefix}_")
    assert len(secret) >= 32
    assert key.encode() not in row.key_hash and secret not in repr(row.__dict__)


def test_wrong_malformed_and_revoked_keys_are_refused(db: sa.Engine) -> None:
    with orm.Session(db) as session, session.begin():
        key, info = create_key(session, "acme")
    prefix, secret = info.prefix, key.split("_", 2)[2]
    wrong_secret = f"tb_{prefix}_{'A' * len(secret)}"
    unknown_prefix = f"tb_00000000_{secret}"
    with orm.Session(db) as session:
        for bad in (wrong_secret, unknown_prefix, key + "x", key[:-1], "", "Bearer " + key):
            assert verify_key(session, bad) is None, bad
        assert verify_key(session, key) is not None
    with orm.Session(db) as session, session.begin():
        assert revoke_key(session, prefix) is not None
    with orm.Session(db) as session:
        assert verify_key(session, key) is None
        assert list_keys(session) == []
        assert [k.prefix for k in list_keys(session, include_revoked=True)] == [prefix]


def test_tenant_names_are_checked() -> None:
    import pytest

    with orm.Session() as session:
        for bad in ("", "a b", "-x", "x" * 65, "ten\x00ant"):
            with pytest.raises(ValueError):
                create_key(session, bad)


def test_thinkbatch_keys_creates_lists_and_revokes(settings: Settings, db: sa.Engine) -> None:
    """`thinkbatch keys ...`, against the database a flag names (as the demo prints it) or
    THINKBATCH_DATABASE_URL."""
    runner = CliRunner()
    url = ["--database-url", settings.require_database_url()]
    created = runner.invoke(app, ["keys", "create", "--tenant", "acme", "--name", "ci", *url])
    assert created.exit_code == 0, created.output
    key = created.stdout.strip()
    prefix = key.split("_")[1]
    env = {"THINKBATCH_DATABASE_URL": settings.require_database_url()}
    listed = runner.invoke(app, ["keys", "list"], env=env)
    assert listed.exit_code == 0 and prefix in listed.stdout and key not in listed.stdout
    revoked = runner.invoke(app, ["keys", "revoke", prefix, *url])
    assert revoked.exit_code == 0, revoked.output
    assert runner.invoke(app, ["keys", "revoke", "ffffffff", *url]).exit_code != 0
    with orm.Session(db) as session:
        assert verify_key(session, key) is None
