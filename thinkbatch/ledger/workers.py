"""The workers table: registration, heartbeats, stops, and which lease owners hold items that
must be released."""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

# pg_advisory_xact_lock key: "tbregst" as an integer, shared by every worker of a deployment.
REGISTER_LOCK_KEY = int.from_bytes(b"tbregst", "big")

# Every statement on the workers table is here, and all of them use the database's clock:
# heartbeats are judged by other hosts, whose clocks may differ from the one that wrote them.


@dataclass(frozen=True, slots=True)
class NameClash:
    """A served name that a live worker of another base model also serves."""

    name: str
    worker_id: str
    hostname: str
    model: str  # that worker's base model
    as_adapter: bool  # whether that worker serves `name` as one of its adapters


class ServedNameTaken(Exception):
    """A worker may not start: names it would serve mean something else on the fleet."""

    def __init__(self, clashes: list[NameClash]):
        self.clashes = clashes
        super().__init__(
            "; ".join(
                f"{c.name!r} is served by worker {c.worker_id} on {c.hostname} as "
                + (f"an adapter of {c.model!r}" if c.as_adapter else "its base model")
                for c in clashes
            )
        )


# An item names the model it runs on by served name, and any live worker serving that name
# claims it. A name must therefore mean one thing across the fleet: an adapter of base B named
# like base A, or adapters of two bases sharing a name, would let one set take (and run on the
# wrong weights) items meant for another. Workers of one base model may differ in adapters: a
# set that rolls out a new adapter serves it on some workers before others. A worker serving
# no adapter has SQL NULL or JSON null there.
_CLASHES = sa.text(
    """
    SELECT w.id, w.hostname, w.model, n.name, n.name <> w.model AS as_adapter
    FROM workers AS w,
         LATERAL (SELECT w.model AS name
                  UNION ALL
                  SELECT jsonb_array_elements_text(CASE jsonb_typeof(w.adapters)
                                                   WHEN 'array' THEN w.adapters
                                                   ELSE '[]' END)) AS n
    WHERE w.stopped_at IS NULL
      AND w.heartbeat_at > now() - make_interval(secs => :dead_after_s)
      AND w.model <> :model
      AND n.name = ANY(:names)
    ORDER BY n.name, w.id
    """
)


def name_clashes(
    conn: sa.Connection, model: str, adapters: list[str] | None, *, dead_after_s: float
) -> list[NameClash]:
    """The served names of a worker of `model` with `adapters` that live workers of other base
    models also serve."""
    rows = conn.execute(
        _CLASHES,
        {"model": model, "names": [model, *(adapters or ())], "dead_after_s": dead_after_s},
    )
    return [NameClash(r.name, r.id, r.hostname, r.model, r.as_adapter) for r in rows]


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
    dead_after_s: float,
) -> None:
    """A worker that is up: its base model, and the served names of the LoRA adapters it serves
    beside it (`adapters`; None: it serves none).

    A name that a worker of another base model serves, one heard from within `dead_after_s`,
    refuses the registration (ServedNameTaken). Registrations take turns on an advisory lock,
    so that two workers starting at once with clashing names cannot both find the other
    absent."""
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": REGISTER_LOCK_KEY})
    clashes = name_clashes(conn, model, adapters, dead_after_s=dead_after_s)
    if clashes:
        raise ServedNameTaken(clashes)
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


# A beat well inside the window (three quarters of it) renews the row alone. One later takes
# the registration lock and checks names first: a registration judging this worker dead by its
# clock may be in flight, and without the lock both could pass.
_BEAT_LIVE = sa.text(
    "UPDATE workers SET heartbeat_at = now() WHERE id = :id AND stopped_at IS NULL "
    "AND heartbeat_at > now() - make_interval(secs => :dead_after_s * 0.75)"
)


def beat(conn: sa.Connection, worker_id: str, *, dead_after_s: float) -> None:
    """The worker is alive, or alive again: a worker judged dead during an outage comes back.

    Its names were free while it was judged dead, and a worker of another base model may have
    registered under one of them since: coming back is then refused (ServedNameTaken), the row
    left stopped, as a registration would be refused, under the same lock."""
    params = {"id": worker_id, "dead_after_s": dead_after_s}
    if conn.execute(_BEAT_LIVE, params).rowcount:
        return  # the common case: one statement
    conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": REGISTER_LOCK_KEY})
    row = conn.execute(
        sa.text("SELECT model, adapters FROM workers WHERE id = :id"), {"id": worker_id}
    ).first()
    if row is not None:
        adapters = row.adapters if isinstance(row.adapters, list) else None
        clashes = name_clashes(conn, row.model, adapters, dead_after_s=dead_after_s)
        if clashes:
            raise ServedNameTaken(clashes)
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
