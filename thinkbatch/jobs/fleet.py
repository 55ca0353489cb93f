"""What the fleet serves, as a submission and `/v1/models` see it: the served names it is
configured for (SERVED_MODELS) and those its live workers serve now (their base model and
adapters, from their heartbeats in the workers table).

A job for a configured name with no live worker is accepted and waits, visibly; a name neither
configured nor served is refused at submit as `model_not_found`, listing what is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field

import sqlalchemy as sa

from thinkbatch.errors import InputError
from thinkbatch.ledger.statuses import LIVE_ITEMS_SQL
from thinkbatch.models import Worker
from thinkbatch.settings import Settings

# Pending and running items by the model they run on, over the jobs with work left (the
# `unfinished` count keeps the scan to those, as the autoscaler's query does).
_WORK_BY_MODEL = sa.text(
    f"""
    SELECT coalesce(i.model, j.model) AS model, i.status::text AS status, count(*) AS n
    FROM items i JOIN jobs j ON j.id = i.job_id
    WHERE j.unfinished > 0 AND i.status IN {LIVE_ITEMS_SQL}
    GROUP BY 1, 2
    """  # noqa: S608 - made of the enum's constants
)


def work_by_model(conn: sa.Connection) -> dict[tuple[str, str], int]:
    """(model, status) -> items, for pending and running items."""
    return {(row.model, row.status): row.n for row in conn.execute(_WORK_BY_MODEL)}


# Read by every poll of a job with pending items: built once, not per call. Judged by the
# database's clock, as every judgement of a heartbeat (thinkbatch/ledger/workers.py).
_LIVE_WORKERS = sa.select(Worker.model, Worker.adapters).where(
    Worker.stopped_at.is_(None),
    Worker.heartbeat_at
    > sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, sa.bindparam("dead_after_s")),
)


def live_workers(conn: sa.Connection, *, dead_after_s: float) -> dict[str, int]:
    """Served name (base model or adapter) -> live workers that serve it."""
    return _live_workers(conn, dead_after_s)[0]


class LiveWorkers:
    """live_workers for the polls of one process, read at most once per `ttl_s`. Every poll of
    a job with pending items asks who serves its models; the answer moves only as workers
    start, stop or miss heartbeats, which are judged seconds apart (HEARTBEAT_S against
    WORKER_DEAD_AFTER_S), so a poll may see it up to `ttl_s` late instead of asking Postgres
    each time."""

    def __init__(self, dead_after_s: float, ttl_s: float):
        self.dead_after_s = dead_after_s
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._read: tuple[float, dict[str, int]] | None = None  # (when, what), shared: read only

    def get(self, conn: sa.Connection) -> dict[str, int]:
        now = time.monotonic()
        with self._lock:
            if self._read is not None and now - self._read[0] < self.ttl_s:
                return self._read[1]
        live = live_workers(conn, dead_after_s=self.dead_after_s)
        with self._lock:
            self._read = (now, live)
        return live


def _live_workers(
    conn: sa.Connection, dead_after_s: float
) -> tuple[dict[str, int], dict[str, str]]:
    counts: dict[str, int] = {}
    adapter_of: dict[str, str] = {}
    rows = conn.execute(_LIVE_WORKERS, {"dead_after_s": dead_after_s})
    for model, adapters in rows:
        for name in (model, *(adapters or ())):
            counts[name] = counts.get(name, 0) + 1
        for name in adapters or ():
            adapter_of[name] = model
    return counts, adapter_of


@dataclass(frozen=True, slots=True)
class ModelLoad:
    model: str
    parent: str | None  # an adapter's base model
    workers: int
    pending: int
    running: int


def parents(settings: Settings, fleet: Fleet) -> dict[str, str]:
    """Adapter -> its base model, as this host's settings and the live workers tell."""
    out = {name: settings.model_name for name in settings.lora_adapters}
    out.update(fleet.adapter_of)
    return out


@dataclass(slots=True)
class Fleet:
    configured: list[str]
    live: dict[str, int] = field(default_factory=dict)
    adapter_of: dict[str, str] = field(default_factory=dict)  # live adapters' base models

    @classmethod
    def read(cls, conn: sa.Connection, settings: Settings) -> Fleet:
        live, adapter_of = _live_workers(conn, settings.worker_dead_after_s)
        return cls(settings.configured_models, live, adapter_of)

    def names(self) -> list[str]:
        """Every name a job may ask for: the configured ones first, then any other served."""
        return [*self.configured, *sorted(set(self.live) - set(self.configured))]

    def check(self, model: str, param: str, what: str | None = None) -> None:
        """A model_not_found naming `param` unless `model` is configured or live; `what`
        says what the name is, when the request did not give it."""
        if model not in self.configured and model not in self.live:
            served = ", ".join(repr(name) for name in self.names())
            raise InputError(
                f"{param}: {what or f'unknown model {model!r}'}; this deployment serves {served}",
                param=param,
                code="model_not_found",
            )

    def waiting_for(self, models: Iterable[str]) -> list[str]:
        """Those of `models` that no live worker serves."""
        return [m for m in models if not self.live.get(m)]
