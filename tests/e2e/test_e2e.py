"""The full path with the real engine: HTTP -> Postgres -> Redis -> Celery worker with vLLM (CPU,
the tiny demo Qwen3) -> Postgres -> HTTP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import sqlalchemy as sa

from tests.helpers import check_invariants
from tests.helpers import wait_until
from tests.stacks import FLOWER_AUTH
from tests.stacks import VLLM_ENV
from tests.stacks import Client
from tests.stacks import RunningStack

pytestmark = pytest.mark.e2e

THINK = {"enable_thinking": True}
NO_THINK = {"enable_thinking": False}
ITEMS: list[dict[str, Any]] = [
    {"custom_id": "think-zh", "messages": [{"role": "user", "content": "解释量子纠缠现象"}],
     "params": THINK},
    {"custom_id": "think-en", "messages": [{"role": "user", "content": "What is 2+2?"}],
     "params": THINK},
    {"custom_id": "default-mode", "messages": [{"role": "user", "content": "What is a KV cache?"}]},
    {"custom_id": "nothink-en", "messages": [{"role": "user", "content": "Name a prime."}],
     "params": NO_THINK},
    {"custom_id": "nothink-zh", "messages": [{"role": "user", "content": "什么是连续批处理？"}],
     "params": NO_THINK},
    {"custom_id": "multi-turn", "params": THINK, "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is vLLM?"},
        {"role": "assistant", "content": "An inference engine for LLMs."},
        {"role": "user", "content": "Why is it fast?"},
    ]},
    {"custom_id": "raw", "prompt": "问题：什么是 PagedAttention？\n回答："},
    # Its floor of tokens (thinkbatch/jobs/context.py) is under the 512-token context, so the
    # API takes it; its real count (609) is over, so the worker fails it alone.
    {"custom_id": "too-long", "messages": [{"role": "user", "content": "token " * 600}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def e2e(
    vllm_stack: RunningStack, worker_metrics_port: int
) -> Iterator[tuple[Client, sa.Engine, str, int | None]]:
    running = vllm_stack
    assert running.api is not None and running.api.port is not None
    assert running.flower is not None
    with Client(running.api.port, running.key()) as client:
        yield client, running.db, running.broker, running.flower.port


def prompt_tokens(item: dict[str, Any]) -> int:
    """What the prompt tokenizes to, computed independently with transformers."""
    from transformers import AutoTokenizer

    from devstack.tiny_model import DEFAULT_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(Path(DEFAULT_DIR)))
    if "prompt" in item:
        return len(tokenizer(item["prompt"]).input_ids)
    text = tokenizer.apply_chat_template(
        item["messages"],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=item.get("params", {}).get("enable_thinking", True),
    )
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def test_a_job_end_to_end(e2e: tuple[Client, sa.Engine, str, int | None]) -> None:
    client, db, broker, flower_port = e2e
    # An item that cannot fit whatever its tokenizer does is refused at submit, from the floor
    # the worker's engine recorded: the whole job with it, naming it, and nothing is stored.
    hopeless = {"custom_id": "hopeless", "messages": [{"role": "user", "content": "token " * 2000}]}
    refused = client.http.post("/v1/jobs", json={"items": [ITEMS[0], hopeless]})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "items[1].messages"
    assert refused.json()["error"]["code"] == "prompt_too_long"
    job = client.submit(ITEMS, params={"temperature": 0, "max_tokens": 200}, metadata={"t": "e2e"})
    assert job["status"] == "queued" and job["counts"]["total"] == len(ITEMS)
    job = client.wait(job["id"], timeout=300)
    assert job["status"] == "completed", job
    assert job["counts"]["succeeded"] == len(ITEMS) - 1 and job["counts"]["failed"] == 1
    check_invariants(db, job["id"])

    items = {item["custom_id"]: item for item in client.all_items(job["id"], page=3)}
    assert list(items) == [i["custom_id"] for i in ITEMS]  # submission order, all pages
    for spec in ITEMS:
        got = items[spec["custom_id"]]
        if spec["custom_id"] == "too-long":
            assert got["status"] == "failed"
            assert got["error"]["code"] == "prompt_too_long"
            assert "tokens" in got["error"]["message"] and "512" in got["error"]["message"]
            continue
        assert got["status"] == "succeeded", got
        thinking_on = "messages" in spec and spec.get("params", {}).get("enable_thinking", True)
        usage = got["usage"]
        assert got["answer"], got
        assert bool(got["thinking"]) == thinking_on, got
        assert got["finish_reason"] in ("stop", "length")
        assert got["thinking_truncated"] is False
        assert usage["prompt_tokens"] == prompt_tokens(spec)
        if thinking_on:
            assert 0 < usage["reasoning_tokens"] < usage["completion_tokens"], got
        else:
            assert usage["reasoning_tokens"] == 0, got
        assert got["attempts"] == 1 and got["error"] is None
        assert got["started_at"] <= got["finished_at"]

    totals = {k: sum((i["usage"] or {}).get(k, 0) for i in items.values()) for k in job["usage"]}
    assert totals == job["usage"]
    # The JSONL download holds exactly the records of the items endpoint.
    assert [json.loads(line) for line in client.results(job["id"])] == list(items.values())

    # The task's result, kept in the backend (Flower's /api/task/result): the final counts.
    # The job completes when its last result is stored; the task that drove it returns at its
    # next look at the job, a moment later (it ran STARTED then, once, under load).
    backend = redis.Redis.from_url(broker)
    n = len(ITEMS)

    def final_counts_stored() -> bool:
        values = [backend.get(k) for k in backend.scan_iter("celery-task-meta-*")]
        states = [json.loads(v) for v in values if v is not None]  # one may expire meanwhile
        return any(
            s["status"] == "SUCCESS"
            and (s["result"] or {}).get("job_id") == job["id"]
            and s["result"]["done"] == n
            and s["result"]["total"] == n
            for s in states
        )

    wait_until(final_counts_stored, 30, "the task's SUCCESS result with the final counts")
    # And Flower, fed by the worker's events, lists the task that drove this job.
    flower = f"http://127.0.0.1:{flower_port}/api/tasks"
    assert httpx.get(flower, timeout=30).status_code == 401  # no credentials, no Flower API
    tasks = httpx.get(flower, auth=tuple(FLOWER_AUTH.split(":", 1)), timeout=30).json()
    ours = [t for t in tasks.values() if job["id"] in (t.get("args") or "")]
    assert ours and {t["name"] for t in ours} == {"thinkbatch.run_job"}
    assert any(t["state"] == "SUCCESS" for t in ours), ours
    # ...with its final progress in the result column Flower prints.
    assert any(f"'progress': '{n}/{n}'" in (t.get("result") or "") for t in ours), ours


def test_thinking_cut_by_max_tokens_is_flagged(
    e2e: tuple[Client, sa.Engine, str, int | None],
) -> None:
    client, db, _, _ = e2e
    job = client.submit(
        [{"custom_id": "cut", "messages": [{"role": "user", "content": "What is vLLM?"}]}],
        params={"temperature": 0, "max_tokens": 4, "enable_thinking": True},
    )
    job = client.wait(job["id"], timeout=120)
    (item,) = client.all_items(job["id"])
    assert item["finish_reason"] == "length"
    assert item["thinking_truncated"] is True
    assert item["thinking"] and item["answer"] == ""
    assert item["usage"]["reasoning_tokens"] == item["usage"]["completion_tokens"] == 4


def test_stop_strings_and_the_one_shot_decode_agree(
    e2e: tuple[Client, sa.Engine, str, int | None],
) -> None:
    """Without stop strings the worker decodes the final token ids itself; with them vLLM's
    incremental detokenizer runs. Both must give the same text, and a stop string must cut."""
    client, _, _, _ = e2e
    question = [{"role": "user", "content": "Why batch prompts?"}]
    params = {"temperature": 0, "max_tokens": 120}

    def run(stop: list[str] | None) -> dict[str, Any]:
        item = {"custom_id": "q", "messages": question, "params": {"stop": stop} if stop else {}}
        job = client.wait(client.submit([item], params=params)["id"], timeout=120)
        (got,) = client.all_items(job["id"])
        assert got["status"] == "succeeded", got
        return got

    plain = run(None)
    never = run(["\u2603 never in the output"])
    for key in ("thinking", "answer", "finish_reason", "usage"):
        assert never[key] == plain[key], key
    cut_at = plain["answer"].split()[-1]  # the last word of the answer
    cut = run([cut_at])
    assert cut["finish_reason"] == "stop"
    assert cut["usage"]["completion_tokens"] < plain["usage"]["completion_tokens"]


def test_the_engines_scheduler_load_is_in_the_worker_metrics(
    e2e: tuple[Client, sa.Engine, str, int | None], worker_metrics_port: int
) -> None:
    """vLLM's per-step scheduler stats reach the worker's gauges while a job runs."""
    client, _, _, _ = e2e
    port = worker_metrics_port
    # Long enough to be sampled while it runs: with 128 items (3-4 s on a faster host) one
    # run in four here saw no sample with a request running.
    items = [{"prompt": f"question {i}"} for i in range(256)]
    job = client.submit(items, params={"max_tokens": 400, "ignore_eos": True})
    seen: dict[str, float] = {}
    vllm_series: set[str] = set()
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> dict[str, float]:
        """The worker's samples by name (labels included), comments left out."""
        samples = {}
        for line in httpx.get(url, timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    deadline = time.monotonic() + 600  # the real CPU engine on a loaded host
    while client.job(job["id"])["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, "the job did not finish within 600 s"
        for name, value in scrape().items():
            if name.startswith("thinkbatch_worker_engine_"):
                seen[name] = max(seen.get(name, 0.0), value)
            elif name.startswith("vllm:"):
                vllm_series.add(name.partition("{")[0])
    assert client.wait(job["id"])["status"] == "completed"
    assert seen["thinkbatch_worker_engine_running_requests"] > 0, seen
    assert 0 < seen["thinkbatch_worker_engine_kv_cache_usage_ratio"] <= 1, seen

    # Its steps and the requests each ran: a request runs one step per token it makes (its
    # prefill step makes the first), so over a job of short items, where an off-by-one per
    # request would show, the requests summed are the job's completion tokens, and their
    # ratio to the steps, the mean batch, is at most MAX_NUM_SEQS (tests/stacks.py).
    def counters() -> tuple[float, float]:
        found = scrape()
        return (
            found["thinkbatch_worker_engine_steps_total"],
            found["thinkbatch_worker_engine_step_requests_total"],
        )

    steps_before, requests_before = counters()
    short = client.submit(
        [{"prompt": f"short {i}"} for i in range(64)], params={"max_tokens": 4, "ignore_eos": True}
    )
    done = client.wait(short["id"])
    assert done["status"] == "completed", done
    steps_after, requests_after = counters()
    tokens = done["usage"]["completion_tokens"]
    assert tokens == 64 * 4, done["usage"]
    assert requests_after - requests_before == tokens
    max_num_seqs = int(VLLM_ENV["THINKBATCH_MAX_NUM_SEQS"])
    assert tokens / max_num_seqs <= steps_after - steps_before <= tokens
    # vLLM's own metrics stay out unless VLLM_METRICS asks for them (worker/vllm_engine.py):
    # the stats the gauges come from are on, and vLLM would otherwise add its Prometheus
    # logger beside ours.
    assert not vllm_series, sorted(vllm_series)[:5]

    # The prefix cache's lookups and hits, in prompt tokens: items that share a long beginning
    # find it cached after the first of them has run; the short prompts above shared nothing.
    def cache() -> tuple[float, float]:
        found = scrape()
        return (
            found["thinkbatch_worker_engine_prefix_cache_queries_total"],
            found["thinkbatch_worker_engine_prefix_cache_hits_total"],
        )

    queries_before, hits_before = cache()
    shared = "Read this carefully before you answer the question that follows. " * 12
    alike = client.submit(
        [{"prompt": f"{shared}Question {i}?"} for i in range(32)],
        params={"max_tokens": 2, "ignore_eos": True},
    )
    assert client.wait(alike["id"])["status"] == "completed"
    queries, hits = cache()
    prompt_tokens = client.job(alike["id"])["usage"]["prompt_tokens"]
    # Every prompt looked up once (more if an item ran again), most of each found cached.
    assert queries - queries_before >= prompt_tokens
    assert 0.5 * prompt_tokens < hits - hits_before < queries - queries_before
