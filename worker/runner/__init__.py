"""The per-process runner, as parts with one concern each (see core.py for the map)."""

from worker.runner.core import EXIT_ENGINE_DEAD
from worker.runner.core import EXIT_SHUTDOWN_TIMEOUT
from worker.runner.core import Runner
from worker.runner.core import check_served_names
from worker.runner.fairness import fair_shares
from worker.runner.window import JobHandle

__all__ = [
    "EXIT_ENGINE_DEAD",
    "EXIT_SHUTDOWN_TIMEOUT",
    "JobHandle",
    "Runner",
    "check_served_names",
    "fair_shares",
]
