"""The workers table: registration, heartbeats, stops, and which lease owners hold items that
must be released."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

# Every statement on the workers table is here, and all of them use the database's clock:
# heartbeats are judged by other hosts, whose clocks may differ from the one that wrote them.


def register_worker(
    conn: sa.Connection,
    worker_id: str,
    *,
    hostname: str,
    pid: int,
    model: str,
    adapters: list[str] | None = None,
    max_model_len: int | None = None,
    token_bytes_max: int | None = None,
    message_tokens_min: int | None = None,
) -> None:
    """A worker that is up: its base model, and the served names of the LoRA adapters it serves
    beside it (`adapters`; None: it serves none)."""
    conn.execute(
        sa.text(
            "INSERT INTO workers (id, hostname, pid, model, adapters, max_model_len, "
            "token_bytes_max, message_tokens_min) "
            "VALUES (:id, :host, :pid, :model, :adapters, :len, :bytes, :per_message)"
        ).bindparams(sa.bindparam("adapters", type_=JSONB)),
        {
            "id": worker_id,
            "host": hostname,
            "pid": pid,
            "model": model,
            "adapters": list(adapters) if adapters else None,
            "len": max_model_len,
            "bytes": token_bytes_max,
            "per_message": message_tokens_min,
        },
    )


def beat(conn: sa.Connection, worker_id: str) -> None:
    """The worker is alive (again: a worker judged dead during an outage comes back)."""
    conn.execute(
        sa.text("UPDATE workers SET heartbeat_at = now(), stopped_at = NULL WHERE id = :id"),
        {"id": worker_id},
    )


def mark_stopped(conn: sa.Connection, worker_id: str) -> None:
    conn.execute(sa.text("UPDATE workers SET stopped_at = now() WHERE id = :id"), {"id": worker_id})


def stop_silent_workers(conn: sa.Connection, *, dead_after_s: float) -> list[str]:
    """Mark workers whose heartbeat stopped `dead_after_s` ago as stopped; returns their ids."""
    return list(
        conn.execute(
            sa.text(
                "UPDATE workers SET stopped_at = now() WHERE stopped_at IS NULL "
                "AND heartbeat_at < now() - make_interval(secs => :s) RETURNING id"
            ),
            {"s": dead_after_s},
        ).scalars()
    )


def owners_to_release(conn: sa.Connection) -> list[tuple[str, bool]]:
    """Lease owners holding items that must be released: (owner, whether it is dead). A dead
    owner is unknown or stopped; a live one holds a lapsed lease."""
    rows = conn.execute(
        sa.text(
            """
            SELECT i.lease_owner, bool_or(w.id IS NULL OR w.stopped_at IS NOT NULL) AS dead
            FROM items AS i LEFT JOIN workers AS w ON w.id = i.lease_owner
            WHERE i.status = 'running'
              AND (i.lease_expires_at < now() OR w.id IS NULL OR w.stopped_at IS NOT NULL)
            GROUP BY i.lease_owner
            """
        )
    ).all()
    return [(owner, dead) for owner, dead in rows]
