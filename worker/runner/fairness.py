"""Fair share of the engine's window between the jobs one process drives: pure functions,
so they are tested without a database or an engine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol
from typing import TypeVar


class Shareable(Protocol):
    @property
    def tenant(self) -> str: ...
    @property
    def weight(self) -> int: ...


H = TypeVar("H", bound=Shareable)


def fair_shares(window: int, handles: Sequence[H]) -> dict[H, float]:
    """Each handle's share of the engine's window: equal between tenants, then by priority
    weight between one tenant's jobs. So a tenant's many jobs (or its high priorities) never
    crowd out another tenant's one job: priority orders a tenant's own work."""
    by_tenant: dict[str, list[H]] = {}
    for handle in handles:
        by_tenant.setdefault(handle.tenant, []).append(handle)
    per_tenant = window / len(by_tenant)
    shares: dict[H, float] = {}
    for own in by_tenant.values():
        total = sum(h.weight for h in own)
        for handle in own:
            shares[handle] = per_tenant * handle.weight / total
    return shares


def pick(
    window: int,
    handles: Sequence[H],
    inflight: dict[H, int],
    *,
    free: int,
    chunk: int,
    claim_min: int,
) -> tuple[H, int]:
    """The job furthest below its share goes next, with how many items to claim for it: its
    deficit, at least `claim_min` (fewer round trips), at most `chunk` and the free room."""
    shares = fair_shares(window, handles)
    best = max(handles, key=lambda h: shares[h] - inflight[h])
    deficit = shares[best] - inflight[best]
    n = min(free, chunk, max(claim_min, math.ceil(deficit)))
    return best, max(1, n)
