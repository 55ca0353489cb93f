"""What the fleet serves, as a submission and `/v1/models` see it: the served names it is
configured for (SERVED_MODELS) and those its live workers serve now (their base model and
adapters, from their heartbeats in the workers table).

A job for a configured name with no live worker is accepted and waits, visibly; a name neither
configured nor served is refused at submit as `model_not_found`, listing what is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from dataclasses import field

import sqlalchemy as sa

from thinkbatch.errors import InputError
from thinkbatch.models import Worker
from thinkbatch.settings import Settings


def _live(dead_after_s: float) -> sa.ColumnElement[bool]:
    # The database's clock, as every judgement of a heartbeat (thinkbatch/ledger/workers.py).
    since = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, dead_after_s)
    return sa.and_(Worker.stopped_at.is_(None), Worker.heartbeat_at > since)


def live_workers(conn: sa.Connection, *, dead_after_s: float) -> dict[str, int]:
    """Served name (base model or adapter) -> live workers that serve it."""
    counts: dict[str, int] = {}
    rows = conn.execute(sa.select(Worker.model, Worker.adapters).where(_live(dead_after_s)))
    for model, adapters in rows:
        for name in (model, *(adapters or ())):
            counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass(slots=True)
class Fleet:
    configured: list[str]
    live: dict[str, int] = field(default_factory=dict)

    @classmethod
    def read(cls, conn: sa.Connection, settings: Settings) -> Fleet:
        return cls(
            settings.configured_models,
            live_workers(conn, dead_after_s=settings.worker_dead_after_s),
        )

    def names(self) -> list[str]:
        """Every name a job may ask for: the configured ones first, then any other served."""
        return [*self.configured, *sorted(set(self.live) - set(self.configured))]

    def check(self, model: str, param: str) -> None:
        if model not in self.configured and model not in self.live:
            served = ", ".join(repr(name) for name in self.names())
            raise InputError(
                f"{param}: unknown model {model!r}; this deployment serves {served}",
                param=param,
                code="model_not_found",
            )

    def waiting_for(self, models: Iterable[str]) -> list[str]:
        """Those of `models` that no live worker serves."""
        return [m for m in models if not self.live.get(m)]
