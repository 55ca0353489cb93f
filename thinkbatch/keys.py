"""API keys: create, verify, list and revoke (the admin commands are `thinkbatch keys ...`,
thinkbatch/cli/keys.py).

A key reads `tb_<prefix>_<secret>`. The prefix (8 hex characters) is stored in clear to find the
key and to name it in listings; of the whole key only a SHA-256 hash is stored. Verification
reads the key's row on every request, so a revocation takes effect on the next request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.db import Prepared
from thinkbatch.models import DEFAULT_TENANT
from thinkbatch.models import ApiKey

_KEY = re.compile(r"tb_([0-9a-f]{8})_([A-Za-z0-9_-]{43})")
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# Compared against when no key has the given prefix, so that an unknown prefix takes as long
# to refuse as a known one with a wrong secret.
_NO_KEY = hashlib.sha256(b"no such key").digest()


@dataclass(frozen=True)
class Caller:
    """Who is calling: the tenant every query of the request is scoped to."""

    tenant: str
    key_prefix: str | None  # None with authentication off


# The caller with authentication off, and of in-process callers (bench, tests' helpers).
LOCAL = Caller(tenant=DEFAULT_TENANT, key_prefix=None)


@dataclass(frozen=True)
class KeyInfo:
    prefix: str
    tenant: str
    name: str
    created_at: datetime
    revoked_at: datetime | None


def _hash(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _info(row: ApiKey) -> KeyInfo:
    return KeyInfo(row.prefix, row.tenant, row.name, row.created_at, row.revoked_at)


def create_key(session: orm.Session, tenant: str, name: str = "") -> tuple[str, KeyInfo]:
    """A new key for `tenant`: (the key, shown once and never stored, and its row's info)."""
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(
            "tenant: 1 to 64 characters of letters, digits, '.', '_' and '-', "
            "starting with a letter or digit"
        )
    while True:
        prefix = secrets.token_hex(4)
        if session.scalar(sa.select(ApiKey.id).where(ApiKey.prefix == prefix)) is None:
            break
    key = f"tb_{prefix}_{secrets.token_urlsafe(32)}"
    created = ledger.insert_key(
        session.connection(), tenant=tenant, name=name[:128], prefix=prefix, key_hash=_hash(key)
    )
    return key, KeyInfo(prefix, tenant, name[:128], created, None)


# Runs on every authenticated request: two columns by the unique prefix, as a plain statement
# (no ORM entity to build), so that a poll pays a round trip for its key and little else.
_VERIFY = Prepared(
    sa.text("SELECT tenant, key_hash FROM api_keys WHERE prefix = :prefix AND revoked_at IS NULL")
)


def verify_key(session: orm.Session | sa.Connection, key: str) -> Caller | None:
    """The caller a presented key stands for, or None for a malformed, unknown or revoked key.
    The comparison of hashes takes the same time whether or not the prefix exists. The row is
    read on every call: a revocation takes effect on the next request."""
    match = _KEY.fullmatch(key)
    presented = _hash(key)
    row = None
    if match:
        row = _VERIFY.first(session, prefix=match.group(1))
    stored = bytes(row[1]) if row is not None else _NO_KEY
    if not hmac.compare_digest(presented, stored) or row is None:
        return None
    return Caller(tenant=row[0], key_prefix=match.group(1) if match else None)


def list_keys(
    session: orm.Session, tenant: str | None = None, *, include_revoked: bool = False
) -> list[KeyInfo]:
    query = sa.select(ApiKey).order_by(ApiKey.tenant, ApiKey.created_at)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return [_info(row) for row in session.scalars(query)]


def revoke_key(session: orm.Session, prefix: str) -> KeyInfo | None:
    if not ledger.revoke_key(session.connection(), prefix):
        return None
    row = session.scalar(
        sa.select(ApiKey).where(ApiKey.prefix == prefix).execution_options(populate_existing=True)
    )
    return _info(row) if row is not None else None


def issue_key(database_url: str, tenant: str, name: str = "") -> str:
    """Create a key in the database at `database_url` (for launchers, benchmarks and tests)."""
    engine = sa.create_engine(database_url)
    try:
        with orm.Session(engine) as session, session.begin():
            key, _ = create_key(session, tenant, name)
    finally:
        engine.dispose()
    return key
