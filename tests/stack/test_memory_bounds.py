"""What one request can cost the API in memory: the peak resident memory of a real API process
(gunicorn, one worker) while it takes the largest body and the largest file its settings accept,
each made of items at the item limits. Bodies are received into a spool (memory only up to
SPOOL_MEMORY_BYTES) and read an item at a time, so the growth is one item's worth, whatever the
body's size: the README states the bound this test holds, BOUND_MIB."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers import Servers
from tests.stacks import running_stack
from thinkbatch.settings import Settings

pytestmark = pytest.mark.slow  # a real server and 2 x 64 MiB of requests

MIB = 1024 * 1024
DEFAULTS = Settings(_env_file=None)  # type: ignore[call-arg]
BODY_BYTES = DEFAULTS.max_request_bytes  # the largest accepted body (256 MiB)
FILE_BYTES = DEFAULTS.max_file_bytes  # the largest accepted file (200 MiB)
# The most a request may add to the API process's peak memory, whatever its size: the
# README's security section states it.
BOUND_MIB = 64


def _peak(pid: int) -> int:
    """The process's peak resident memory so far (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _items(limit: int) -> Iterator[dict[str, object]]:
    """Items at the limits, alternately a 900,000-character prompt and 1,024 messages of 900
    characters each, until `limit` bytes of JSON."""
    size, n = 0, 0
    while True:
        if n % 2 == 0:
            item: dict[str, object] = {"custom_id": f"p{n}", "prompt": "x" * 900_000}
        else:
            item = {"custom_id": f"m{n}",
                    "messages": [{"role": "user", "content": "y" * 900}] * 1024}  # fmt: skip
        size += len(json.dumps(item)) + 1
        if size > limit:
            return
        yield item
        n += 1


def test_the_largest_body_and_file_cost_one_item_of_memory(
    servers: Servers, tmp_path: Path
) -> None:
    with running_stack(servers, tmp_path, "memory", workers=(), THINKBATCH_API_WORKERS="1") as api:
        assert api.api is not None
        [worker] = psutil.Process(api.api.pid).children()
        base = api.base_url
        auth = {"Authorization": f"Bearer {api.key()}"}
        with httpx.Client(base_url=base, headers=auth, timeout=600) as http:
            warm = http.post("/v1/jobs", json={"items": [{"prompt": "warm"}]})
            assert warm.status_code == 201, warm.text
            at_rest = _peak(worker.pid)

            body = json.dumps({"items": list(_items(BODY_BYTES))}).encode()
            assert BODY_BYTES - 2 * MIB < len(body) <= BODY_BYTES
            job = http.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert job.status_code == 201, job.text[:300]
            after_body = _peak(worker.pid)

            lines = b"".join(
                json.dumps(
                    {"custom_id": f"l{n}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "thinkbatch-demo",
                              "messages": item.get("messages")
                              or [{"role": "user", "content": item["prompt"]}]}}
                ).encode() + b"\n"
                for n, item in enumerate(_items(FILE_BYTES))
            )  # fmt: skip
            del body
            assert FILE_BYTES - 2 * MIB < len(lines) <= FILE_BYTES
            upload = http.post(
                "/v1/files",
                files={"file": ("big.jsonl", io.BytesIO(lines), "application/jsonl")},
                data={"purpose": "batch"},
            )
            assert upload.status_code == 200, upload.text[:300]
            batch = http.post(
                "/v1/batches",
                json={"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": "24h"},
            )  # fmt: skip
            assert batch.json()["status"] == "in_progress", batch.json()
            after_file = _peak(worker.pid)
    growth = max(after_body, after_file) - at_rest
    print(
        f"API process peak: {at_rest / MIB:.0f} MiB at rest, +{(after_body - at_rest) / MIB:.0f}"
        f" MiB for a {BODY_BYTES // MIB} MiB body, +{(after_file - at_rest) / MIB:.0f} MiB with "
        f"a {len(lines) / MIB:.0f} MiB file uploaded and made a batch"
    )
    assert growth < BOUND_MIB * MIB
