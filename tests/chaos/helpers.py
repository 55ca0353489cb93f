"""The chaos suite's shared types and its report lines (printed by conftest at the end of the
run). Scenarios import these from here, never from conftest.py."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from devstack.services import LocalPostgres
from devstack.services import LocalRedis
from devstack.stack import Stack
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import Client
from tests.stacks import make_stack


@dataclass
class ScenarioReport:
    name: str
    items: int
    faults: int
    lost: int
    duplicated: int
    recover_s: float  # from the end of the last fault to the next finished item
    finish_s: float  # from the end of the last fault to the job's end
    note: str = ""


REPORTS: list[ScenarioReport] = []


@dataclass
class Chaos:
    pg: LocalPostgres
    redis: LocalRedis
    database_url: str
    db: sa.Engine
    stack: Stack
    client: Client
    log_dir: Path

    def worker_stack(self, name: str, **env: str) -> Stack:
        """A stack for this scenario's workers (stopped by the scenario)."""
        return make_stack(
            self.log_dir / name, self.database_url, self.redis.url(0), **FAST_RECOVERY_ENV, **env
        )
