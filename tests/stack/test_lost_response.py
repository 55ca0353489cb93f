"""A submit whose response was lost, against a real server: the client retries with the same
Idempotency-Key and finds the one job its first request made (tests/api/test_idempotency.py
holds the rest of the contract)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from tests.helpers import Servers
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # a real server

BODY = {"items": [{"custom_id": "a", "prompt": "hello"}], "metadata": {"run": "1"}}


def _jobs(db: sa.Engine) -> list[str]:
    with db.connect() as conn:
        return [str(i) for i in conn.execute(sa.text("SELECT id FROM jobs")).scalars()]


def test_a_submit_whose_response_was_lost_makes_one_job(servers: Servers, tmp_path: Path) -> None:
    """The client sends its submit and goes away before the answer (a timeout, a dropped
    connection); its retry with the same key finds the job the first one made."""
    with running_stack(servers, tmp_path, "idempotency", workers=()) as api:
        key, db = api.key(), api.db
        body = json.dumps(BODY).encode()
        sock = socket.create_connection(("127.0.0.1", int(api.base_url.rsplit(":", 1)[1])))
        sock.sendall(
            b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nIdempotency-Key: lost-1\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        deadline = time.monotonic() + 10
        while not _jobs(db) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_jobs(db)) == 1  # the first request was stored...
        sock.close()  # ...and its answer never read
        retry = httpx.post(
            f"{api.base_url}/v1/jobs",
            content=body,
            headers={"Authorization": f"Bearer {key}", "Idempotency-Key": "lost-1",
                     "Content-Type": "application/json"},
            timeout=10,
        )  # fmt: skip
        assert retry.status_code == 201, retry.text
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert _jobs(db) == [retry.json()["id"]]
