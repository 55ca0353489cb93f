"""The end-to-end tier's one vLLM stack: the API, Flower and a worker with the real CPU engine on
the tiny demo model, started once for every module that needs them (an engine takes 20-40 s to
start here), on a database and a Redis database of its own."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from devstack.services import free_port
from tests.helpers import Servers
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import VLLM_ENV
from tests.stacks import RunningStack
from tests.stacks import build_demo_model
from tests.stacks import running_stack

EFFORTS = {"minimal": 4, "low": 8, "medium": 16, "high": None}


@pytest.fixture(scope="session")
def worker_metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def vllm_stack(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory, worker_metrics_port: int
) -> Iterator[RunningStack]:
    build_demo_model()
    with running_stack(
        servers,
        tmp_path_factory.mktemp("e2e"),
        "e2e",
        flower=True,
        worker_env={
            "THINKBATCH_WORKER_METRICS_PORT": str(worker_metrics_port),
            # Budgets the tiny model's short thinking can reach (test_vocabulary_vllm.py).
            "THINKBATCH_REASONING_EFFORT_BUDGETS": json.dumps(EFFORTS),
        },
        **VLLM_ENV,
        **FAST_RECOVERY_ENV,
    ) as running:
        yield running
