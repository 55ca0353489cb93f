"""What runs beside the API, attacked as a local process would: a pickled message put straight on
the queue, Flower without credentials, and secrets in tracked files."""

from __future__ import annotations

import pickle
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kombu import Connection
from kombu import Exchange
from kombu import Producer

from devstack.stack import Proc
from devstack.stack import Stack
from tests.helpers import Servers
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import FLOWER_AUTH
from tests.stacks import Client
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes, the fake engine


class Boom:
    """What a pickle can do when it is loaded: here, create a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (self.marker,))


@pytest.fixture(scope="module")
def fake_stack(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, Proc, Proc, Client, str]]:
    with running_stack(
        servers,
        tmp_path_factory.mktemp("security"),
        "security",
        flower=True,
        THINKBATCH_ENGINE="fake",
        THINKBATCH_MODEL="thinkbatch-demo",
        **FAST_RECOVERY_ENV,
    ) as running:
        stack, api, flower = running.stack, running.api, running.flower
        worker = next(p for p in stack.procs if p.name == "worker")
        assert api is not None and api.port is not None and flower is not None
        with Client(api.port, running.key()) as client:
            yield stack, worker, flower, client, running.broker


def test_a_pickled_message_is_refused_and_the_worker_lives_on(
    fake_stack: tuple[Stack, Proc, Proc, Client, str], tmp_path: Path
) -> None:
    stack, worker, _, client, broker = fake_stack
    marker = tmp_path / "pickle-was-loaded"
    with Connection(broker) as conn:
        producer = Producer(conn, exchange=Exchange("thinkbatch", type="direct"))
        producer.publish(
            pickle.dumps(Boom(marker)),
            routing_key="thinkbatch",
            serializer=None,
            content_type="application/x-python-serialize",
            content_encoding="binary",
            headers={"task": "thinkbatch.run_job", "id": "evil-1", "lang": "py", "argsrepr": ""},
        )
    deadline = time.monotonic() + 20
    while "untrusted content" not in worker.log_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "untrusted content" in worker.log_text(), worker.log_text()[-2000:]
    assert not marker.exists()
    assert worker.alive()
    # ...and still does its work.
    job = client.submit([{"prompt": "still alive?"}])
    assert client.wait(job["id"], timeout=60)["status"] == "completed"


def test_flower_refuses_calls_without_credentials(
    fake_stack: tuple[Stack, Proc, Proc, Client, str],
) -> None:
    _, worker, flower, _, _ = fake_stack
    base = f"http://127.0.0.1:{flower.port}"
    user, password = FLOWER_AUTH.split(":", 1)
    for path in ("/", "/tasks", "/api/tasks", "/api/workers"):
        assert httpx.get(base + path, timeout=30).status_code == 401, path
        assert httpx.get(base + path, auth=(user, "wrong"), timeout=30).status_code == 401
    # The dangerous calls too: shutting a worker down or revoking a task.
    name = "worker@" + subprocess.run(["hostname"], capture_output=True, text=True).stdout.strip()
    shutdown = httpx.post(f"{base}/api/worker/shutdown/{name}", timeout=30)
    assert shutdown.status_code == 401
    assert httpx.post(f"{base}/api/task/revoke/some-id", timeout=30).status_code == 401
    assert worker.alive()
    assert httpx.get(base + "/api/workers", auth=(user, password), timeout=30).status_code == 200
