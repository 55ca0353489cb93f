"""API keys: a new key's row, and its revocation."""

from __future__ import annotations

from datetime import datetime

import sqlalchemy as sa

from thinkbatch.models import ApiKey


def insert_key(
    conn: sa.Connection, *, tenant: str, name: str, prefix: str, key_hash: bytes
) -> datetime:
    """Store a key's hash; returns when it was made."""
    return conn.execute(
        sa.insert(ApiKey)
        .values(tenant=tenant, name=name, prefix=prefix, key_hash=key_hash)
        .returning(ApiKey.created_at)
    ).scalar_one()


def revoke_key(conn: sa.Connection, prefix: str) -> bool:
    """Refused from the next request on; False when no key has the prefix."""
    found = conn.execute(
        sa.update(ApiKey)
        .where(ApiKey.prefix == prefix)
        .values(revoked_at=sa.func.coalesce(ApiKey.revoked_at, sa.func.now()))
        .returning(ApiKey.id)
    ).first()
    return found is not None
