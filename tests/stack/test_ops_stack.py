"""Operations against the real stack (gunicorn API, a Celery worker with the fake engine, Flower
behind basic auth): Flower shows a job's progress, both /metrics agree with the job's counts,
and the dashboard works in headless Chromium. Screenshots go to tests/artifacts/."""

from __future__ import annotations

import ast
import base64
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from devstack.services import free_port
from tests.browser import ARTIFACTS
from tests.browser import Browser
from tests.browser import find_chromium
from tests.helpers import Servers
from tests.stacks import FAST_RECOVERY_ENV
from tests.stacks import FLOWER_AUTH
from tests.stacks import Client
from tests.stacks import running_stack

pytestmark = pytest.mark.slow  # real processes, the fake engine

ITEMS = 40
CHROMIUM = find_chromium()


@pytest.fixture(scope="module")
def ops_stack(servers: Servers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    metrics_port = free_port()
    with running_stack(
        servers, tmp_path_factory.mktemp("ops"), "ops", flower=True,
        THINKBATCH_ENGINE="fake", THINKBATCH_MODEL="thinkbatch-demo", THINKBATCH_MAX_NUM_SEQS="4",
        THINKBATCH_ENGINE_EXTRA_ARGS='{"step_s": 0.02}',
        THINKBATCH_WORKER_METRICS_PORT=str(metrics_port), **FAST_RECOVERY_ENV,
    ) as running:  # fmt: skip
        stack, api, flower = running.stack, running.api, running.flower
        worker = next(p for p in stack.procs if p.name == "worker")
        key = running.key()
        assert api is not None and api.port is not None
        with Client(api.port, key) as client:
            yield stack, api, flower, worker, client, key, metrics_port


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def test_flower_progress_metrics_and_dashboard(ops_stack: Any) -> None:
    stack, api, flower, worker, client, key, metrics_port = ops_stack
    user, password = FLOWER_AUTH.split(":", 1)
    flower_url = f"http://127.0.0.1:{flower.port}"
    items: list[dict[str, Any]] = [
        {"custom_id": f"i{k}", "messages": [{"role": "user", "content": f"question {k}"}]}
        for k in range(ITEMS - 1)
    ]
    items.append({"custom_id": "bad", "prompt": "[[fail-submit]]"})
    job = client.submit(items, params={"max_tokens": 80})
    job_id = job["id"]

    browser = Browser(CHROMIUM) if CHROMIUM else None
    # Flower's /api/tasks keeps only a task's latest PROGRESS, so it is sampled on its own thread:
    # the browser's page loads below take seconds on a slow host and would hide the values between.
    seen: list[dict[str, Any]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def sample_flower() -> None:
        with httpx.Client(auth=(user, password), timeout=30) as flower_client:
            while not stop.is_set():
                try:
                    tasks = flower_client.get(f"{flower_url}/api/tasks").json()
                except httpx.HTTPError:
                    tasks = {}
                for task in tasks.values():
                    if task.get("args") and job_id in task["args"] and task.get("result"):
                        try:
                            result = ast.literal_eval(task["result"])
                        except (ValueError, SyntaxError):
                            continue
                        with lock:
                            seen.append({"state": task["state"], **result})
                stop.wait(0.5)

    def last_done() -> int | None:
        with lock:
            return seen[-1]["done"] if seen else None

    sampler = threading.Thread(target=sample_flower, name="flower-sampler", daemon=True)
    sampler.start()
    shots: list[str] = []
    try:
        if browser:
            api_url = f"http://127.0.0.1:{api.port}"
            browser.call("Network.setCookie", name="thinkbatch_key", value=key, url=api_url,
                         httpOnly=True, sameSite="Strict")  # fmt: skip
        deadline = time.monotonic() + 180
        progress_pages: list[str] = []
        while time.monotonic() < deadline:
            state = client.job(job_id)
            if browser and state["status"] == "running" and len(progress_pages) < 2:
                browser.open(f"{api_url}/")
                progress_pages.append(browser.text())
                shots.append(
                    str(browser.screenshot(f"dashboard-running-{len(progress_pages)}.png"))
                )
                if len(progress_pages) == 1:
                    auth = base64.b64encode(FLOWER_AUTH.encode()).decode()
                    browser.call(
                        "Network.setExtraHTTPHeaders", headers={"Authorization": f"Basic {auth}"}
                    )
                    browser.open(f"{flower_url}/tasks", settle=3)
                    shots.append(str(browser.screenshot("flower-tasks-running.png")))
                    browser.call("Network.setExtraHTTPHeaders", headers={})
            if state["status"] == "completed" and last_done() == ITEMS:
                break
            time.sleep(1)
        stop.set()
        sampler.join(timeout=60)
        final = client.job(job_id)
        assert final["status"] == "completed", final
        # Flower showed the job's progress rising, with a rate, and ending at the total.
        running = [s for s in seen if s["state"] == "PROGRESS"]
        assert running, seen[:5]
        dones = [s["done"] for s in seen]
        assert dones == sorted(dones) and dones[-1] == ITEMS, dones
        assert len(set(dones)) >= 3, dones
        assert all(s["job_id"] == job_id and s["total"] == ITEMS for s in seen)
        assert any(s["items_per_s"] > 0 for s in seen)
        # Workers show their engine in Flower.
        workers = httpx.get(
            f"{flower_url}/api/workers?refresh=1", auth=(user, password), timeout=60
        ).json()
        engine = next(iter(workers.values()))["stats"]["thinkbatch"]
        assert engine["model"] == "thinkbatch-demo" and engine["engine"] == "fake"

        # Both /metrics endpoints agree with the job's counts.
        counts = final["counts"]
        api_metrics = httpx.get(f"http://127.0.0.1:{api.port}/metrics", timeout=30).text
        assert _sample(api_metrics, "thinkbatch_api_jobs_submitted_total") == 1
        assert _sample(api_metrics, "thinkbatch_api_items_submitted_total") == ITEMS
        assert _sample(api_metrics, "thinkbatch_api_requests_total", route="/v1/jobs",
                       method="POST", status="201") == 1  # fmt: skip
        w = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).text
        assert _sample(w, "thinkbatch_worker_items_succeeded_total") == counts["succeeded"]
        assert _sample(w, "thinkbatch_worker_items_failed_total") == counts["failed"] == 1
        assert _sample(w, "thinkbatch_worker_items_failed_total", code="invalid_request") == 1
        usage = final["usage"]
        for kind in ("prompt", "completion", "reasoning"):
            assert (
                _sample(w, "thinkbatch_worker_tokens_total", kind=kind) == usage[f"{kind}_tokens"]
            )
        assert (
            _sample(w, "thinkbatch_worker_item_latency_seconds_count", phase="engine")
            == (counts["succeeded"])
        )
        assert _sample(w, "thinkbatch_worker_items_in_engine") == 0

        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "api-metrics.txt").write_text(api_metrics)
        (ARTIFACTS / "worker-metrics.txt").write_text(w)
        # Logs are JSON lines with ids, and no item text.
        api_log = api.log_text()
        assert re.search(r'"request_id": "[0-9a-f]{32}"', api_log)
        assert f'"job_id": "{job_id}"' in worker.log_text()
        assert "question 7" not in api_log + worker.log_text()

        if browser:
            # The running job's progress changed between two loads of the list.
            assert len(progress_pages) == 2 and progress_pages[0] != progress_pages[1]
            browser.open(f"{api_url}/jobs/{job_id}")
            browser.call(
                "Runtime.evaluate",
                expression="document.querySelectorAll('details').forEach(d => d.open = true)",
            )
            page = browser.text()
            shots.append(str(browser.screenshot("dashboard-job-finished.png")))
            assert "thinking" in page and "invalid_request" in page
            answers = browser.text(
                "[...document.querySelectorAll('pre.answer')].map(e => e.innerText)"
            )
            thoughts = browser.text(
                "[...document.querySelectorAll('pre.thinking')].map(e => e.innerText)"
            )
            assert answers and all(answers) and thoughts and all(thoughts)
            browser.open(f"{api_url}/jobs/{job_id}/timeline")
            assert browser.text("document.querySelectorAll('svg polyline').length") == 1
            shots.append(str(browser.screenshot("dashboard-timeline.png")))
            assert browser.console_errors == []
        print("screenshots:", shots)
    finally:
        stop.set()
        if browser:
            browser.close()
    if not CHROMIUM:
        pytest.skip("chromium not found (apt-get install chromium): browser checks not run")
