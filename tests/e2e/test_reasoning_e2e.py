"""Reasoning controls on vLLM's CPU engine with the demo model, through the worker's runner:
the thinking budget (the engine's own, configured from the model's <think>/</think> ids), and
speculative decoding (n-gram prompt lookup) leaving greedy answers unchanged.

Each module run starts two engines (without and with speculation), about a minute on 2 cores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from devstack.stack import settings_env
from tests.helpers import Servers
from tests.helpers import job_records
from tests.helpers import make_settings
from tests.helpers import submit_job
from tests.runner_harness import close_runner
from tests.stacks import VLLM_ENV
from tests.stacks import running_stack
from thinkbatch.settings import Settings
from worker.engine import create_engine
from worker.runner import Runner

pytestmark = pytest.mark.e2e

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
QUESTION = [{"role": "user", "content": "What is continuous batching in vLLM?"}]
GREEDY = {"temperature": 0.0}
ANSWER = (
    "Continuous batching adds new requests to the running batch at every step and frees "
    "finished ones at once, so the GPU never idles."
)


def _budget_items() -> list[dict[str, Any]]:
    return [
        {"custom_id": "b4", "messages": QUESTION, "params": {**GREEDY, "thinking_budget": 4}},
        {"custom_id": "b16", "messages": QUESTION, "params": {**GREEDY, "thinking_budget": 16}},
        {"custom_id": "none", "messages": QUESTION, "params": GREEDY},
        # Without a budget the model is cut inside its thinking; with one it answers.
        {"custom_id": "cut", "messages": QUESTION, "params": {**GREEDY, "max_tokens": 16}},
        {"custom_id": "cut-b", "messages": QUESTION,
         "params": {**GREEDY, "max_tokens": 16, "thinking_budget": 4}},
    ]  # fmt: skip


def _quoting_items() -> list[dict[str, Any]]:
    """Conversations whose answer is already in the prompt: where prompt lookup drafts well."""
    return [
        {
            "custom_id": f"quote-{k}",
            "messages": [
                {"role": "user", "content": "What is continuous batching?"},
                {"role": "assistant", "content": ANSWER},
                {"role": "user", "content": QUESTION[0]["content"]},
            ],
            "params": {**GREEDY, "enable_thinking": k % 2 == 0},
        }
        for k in range(4)
    ]


@pytest.fixture(scope="module")
def vllm_db(
    servers: Servers, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, sa.Engine]]:
    # No process: the runner runs here, in-process, on the stack's database and Redis.
    with running_stack(
        servers, tmp_path_factory.mktemp("reasoning"), "reasoning", api=False, workers=()
    ) as running:
        yield running.database_url, running.broker, running.db


def _settings(url: str, redis_url: str, **overrides: Any) -> Settings:
    env = settings_env(VLLM_ENV)
    return make_settings(
        url,
        redis_url,
        **{**env, "item_deadline_s": 120, "lease_s": 180, "visibility_timeout_s": 600, **overrides},
    )


def _run(settings: Settings, db: sa.Engine, items: list[dict[str, Any]]) -> dict[str, Any]:
    """One job on a fresh runner with this engine; every item record by custom_id, and the
    engine's speculative decoding figures."""
    job_id = submit_job(db, settings, {"items": items})
    engine = create_engine(settings)
    runner = Runner(settings, engine=engine, db=db, publish=lambda _: True)
    runner.start()
    try:
        thread = threading.Thread(target=lambda: runner.drive(job_id, lambda d, t: None))
        thread.start()
        thread.join(240)
        spec_stats = engine.speculative_stats()
    finally:
        close_runner(runner, timeout=30)
    records = job_records(db, settings, job_id)
    assert all(r["status"] == "succeeded" for r in records.values()), records
    return {"items": records, "speculative": spec_stats}


@pytest.fixture(scope="module")
def plain(vllm_db: tuple[str, str, sa.Engine]) -> dict[str, Any]:
    url, redis_url, db = vllm_db
    return _run(_settings(url, redis_url), db, _budget_items() + _quoting_items())


@pytest.fixture(scope="module")
def speculative(vllm_db: tuple[str, str, sa.Engine], plain: dict[str, Any]) -> dict[str, Any]:
    url, redis_url, db = vllm_db
    return _run(_settings(url, redis_url, speculative_config=NGRAM), db,
                _budget_items() + _quoting_items())  # fmt: skip


def test_the_thinking_budget_closes_the_thinking_and_the_model_answers(
    plain: dict[str, Any],
) -> None:
    got = plain["items"]
    for name, budget in (("b4", 4), ("b16", 16)):
        item = got[name]
        assert item["usage"]["reasoning_tokens"] <= budget + 1, item
        assert item["answer"], item
        assert item["thinking_truncated"] is True, item
        assert item["finish_reason"] == "stop", item
    free = got["none"]
    assert free["answer"] and free["thinking_truncated"] is False, free
    assert free["usage"]["reasoning_tokens"] > 17  # it thinks longer than the 16 budget
    # Thought past max_tokens without a budget: no answer; with one, an answer within it.
    assert got["cut"]["answer"] == "" and got["cut"]["thinking_truncated"] is True
    assert got["cut-b"]["answer"], got["cut-b"]
    assert got["cut-b"]["usage"]["reasoning_tokens"] <= 5


def test_speculation_runs_and_leaves_greedy_answers_unchanged(
    plain: dict[str, Any], speculative: dict[str, Any]
) -> None:
    stats = speculative["speculative"]
    assert plain["speculative"] is None
    assert stats is not None and stats.drafts > 0 and stats.accepted_tokens > 0, stats
    print(stats.summary())
    for custom_id, record in plain["items"].items():
        other = speculative["items"][custom_id]
        assert (other["thinking"], other["answer"]) == (record["thinking"], record["answer"])
        assert other["usage"] == record["usage"]
        assert other["thinking_truncated"] == record["thinking_truncated"]


def _words(text: str) -> list[str]:
    return [w.strip(".,;:!?\"'()") for w in text.split()]


@pytest.fixture(scope="module")
def stopped(vllm_db: tuple[str, str, sa.Engine], plain: dict[str, Any]) -> dict[str, Any]:
    """The free item again, with stop strings taken from its own greedy output: one that its
    thinking holds and its answer does not, and one that both hold."""
    url, redis_url, db = vllm_db
    free = plain["items"]["none"]
    thinking, answer = free["thinking"], free["answer"]
    in_thinking = next(w for w in _words(thinking) if len(w) >= 4 and w not in answer)
    answer_words = _words(answer)
    in_both = next(w for w in answer_words[1:] if len(w) >= 3 and w in thinking)
    items = [
        {"custom_id": "thinking-only", "messages": QUESTION,
         "params": {**GREEDY, "stop": [in_thinking]}},
        {"custom_id": "both", "messages": QUESTION, "params": {**GREEDY, "stop": [in_both]}},
        {"custom_id": "choices", "messages": QUESTION,
         "params": {"temperature": 0.8, "seed": 3, "stop": [in_both], "n": 2, "logprobs": True}},
    ]  # fmt: skip
    return {"run": _run(_settings(url, redis_url), db, items), "words": (in_thinking, in_both)}


def test_stop_strings_end_the_answer_never_the_thinking(
    plain: dict[str, Any], stopped: dict[str, Any]
) -> None:
    free = plain["items"]["none"]
    got = stopped["run"]["items"]
    in_thinking, in_both = stopped["words"]
    # vLLM matches stop strings over the whole output: given them, it would have ended both
    # items inside their thinking, with no answer.
    untouched = got["thinking-only"]
    assert in_thinking in untouched["thinking"]
    assert (untouched["thinking"], untouched["answer"]) == (free["thinking"], free["answer"])
    assert untouched["usage"] == free["usage"] and untouched["finish_reason"] == "stop"
    cut = got["both"]
    assert in_both in cut["thinking"] and cut["thinking"] == free["thinking"]
    expected = free["answer"][: free["answer"].index(in_both)]
    assert cut["answer"].rstrip() == expected.rstrip() and in_both not in cut["answer"]
    assert cut["finish_reason"] == "stop" and cut["thinking_truncated"] is False
    tokens, reasoning = cut["usage"]["completion_tokens"], cut["usage"]["reasoning_tokens"]
    assert reasoning == free["usage"]["reasoning_tokens"]
    assert reasoning < tokens < free["usage"]["completion_tokens"]
    # Each of n sampled choices ends at its own answer's stop, and the logprobs are those of
    # the first choice's answer.
    sampled = got["choices"]
    assert len(sampled["choices"]) == 2
    assert all(in_both not in c["answer"] for c in sampled["choices"]), sampled["choices"]
    # The tokens cover the answer; the last may also hold the stop string's first characters.
    joined = "".join(t["token"] for t in sampled["logprobs"])
    assert joined.startswith(sampled["answer"]), (joined, sampled["answer"])
    assert in_both.startswith(joined[len(sampled["answer"]) :].strip())
