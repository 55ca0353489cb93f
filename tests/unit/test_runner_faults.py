"""The runner never strands a claimed item: a failure at any stage between the claim and the
engine ends exactly the items concerned, the job reaches a terminal state, and the worker keeps
serving. A long prompt's tokenizing does not hold back the other items."""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import sqlalchemy as sa

from tests.helpers import check_invariants
from tests.helpers import seed_job
from tests.helpers import submit_job
from tests.runner_harness import Harness
from tests.runner_harness import job_row
from tests.runner_harness import wait_status
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import resolve_sampling
from thinkbatch.settings import Settings

N = 40
BAD = {3, 17, 18, 31}  # 17 and 18 share a launch slice


def create_job(db: sa.Engine, settings: Settings, items: list[dict[str, Any]]) -> uuid.UUID:
    return submit_job(db, settings, {"items": items})


def store(db: sa.Engine, sql: str, **params: Any) -> None:
    """Write values the API would refuse, as a row stored before a limit existed would hold."""
    with db.begin() as conn:
        conn.execute(sa.text(sql), params)


def items_by_status(db: sa.Engine, job_id: uuid.UUID) -> dict[str, dict[str, tuple[Any, ...]]]:
    with db.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT custom_id, status, error_code, error_message, attempts FROM items"
                " WHERE job_id = :id"
            ),
            {"id": job_id},
        ).all()
    out: dict[str, dict[str, tuple[Any, ...]]] = {}
    for row in rows:
        out.setdefault(row.status, {})[row.custom_id] = (
            row.error_code,
            row.error_message,
            row.attempts,
        )
    return out


def run_to_end(h: Harness, runner: Any, job_id: uuid.UUID, timeout: float = 15) -> Any:
    started = time.monotonic()
    thread, _ = h.drive(runner, job_id)
    thread.join(timeout)
    assert not thread.is_alive(), "the task thread never returned"
    row = wait_status(h.db, job_id, {"completed", "failed"}, timeout=2)
    assert time.monotonic() - started < timeout
    return row


MARKERS = {
    "render": "[[fail-render]]",
    "tokenize": "[[fail-tokenize]]",
    "params": "[[fail-params]]",
    "submit": "[[fail-submit]]",
}


@pytest.mark.parametrize("stage", ["resolve", *MARKERS])
def test_a_failure_at_any_stage_fails_only_the_items_concerned(
    harness: Harness,
    stage: str,
) -> None:
    runner = harness.runner()
    marker = MARKERS.get(stage, "")
    items: list[dict[str, Any]] = []
    for k in range(N):
        text = f"question {k} {marker}" if k in BAD else f"question {k}"
        # Chat items go through the chat template, raw prompts do not: have both.
        if k % 2:
            items.append({"custom_id": f"i{k}", "messages": [{"role": "user", "content": text}]})
        else:
            items.append({"custom_id": f"i{k}", "prompt": text})
    job_id = create_job(harness.db, harness.settings, items)
    if stage == "resolve":  # a stored value the worker cannot turn into sampling parameters
        store(
            harness.db,
            "UPDATE items SET params = CAST(:p AS jsonb) WHERE job_id = :j AND custom_id = ANY(:c)",
            p=json.dumps({"max_tokens": "plenty"}),
            j=job_id,
            c=[f"i{k}" for k in BAD],
        )
    row = run_to_end(harness, runner, job_id)
    assert row.status == "completed"
    by_status = items_by_status(harness.db, job_id)
    assert set(by_status) == {"succeeded", "failed"}, by_status.keys()
    failed = by_status["failed"]
    assert set(failed) == {f"i{k}" for k in BAD}
    assert len(by_status["succeeded"]) == N - len(BAD)
    for code, message, attempts in failed.values():
        assert code == "invalid_request" and message, (code, message)
        assert attempts == 1  # its batch-mates got through: the item is the cause, at once
    check_invariants(harness.db, job_id)

    # The worker keeps serving: no task thread, window slot or claim was lost.
    assert runner.inflight.count == 0
    follow = seed_job(harness.db, harness.settings, n=30)
    assert run_to_end(harness, runner, follow).succeeded == 30


def test_values_the_engine_refuses_end_the_job_and_cancel_still_works(
    harness: Harness,
) -> None:
    """The issue's example: temperature 3.0 (vLLM allows at most 2) and stop "" on every item.
    No item can run; each fails with the engine's message and the job ends."""
    runner = harness.runner(max_attempts=2)
    job_id = seed_job(harness.db, harness.settings, n=5)
    store(harness.db, "UPDATE jobs SET params = CAST(:p AS jsonb) WHERE id = :j",
          p=json.dumps({"temperature": 3.0}), j=job_id)  # fmt: skip
    row = run_to_end(harness, runner, job_id)
    assert (row.status, row.failed) == ("completed", 5)
    failed = items_by_status(harness.db, job_id)["failed"]
    assert {(code, "temperature" in message) for code, message, _ in failed.values()} == {
        ("invalid_request", True)
    }
    check_invariants(harness.db, job_id)

    # And stop "": cancelling the job while it runs ends it as cancelled, not `cancelling`.
    job_id = seed_job(harness.db, harness.settings, n=5)
    store(harness.db, "UPDATE items SET params = CAST(:p AS jsonb) WHERE job_id = :j",
          p=json.dumps({"stop": [""]}), j=job_id)  # fmt: skip
    thread, _ = harness.drive(runner, job_id)
    with harness.db.begin() as conn:
        from thinkbatch import ledger

        ledger.cancel_job(conn, job_id)
    thread.join(15)
    assert not thread.is_alive()
    assert wait_status(harness.db, job_id, {"cancelled", "completed"}, timeout=2)
    check_invariants(harness.db, job_id)


def test_a_broken_tokenizer_costs_the_items_an_attempt_not_their_result(
    harness: Harness,
) -> None:
    """When every item of a batch fails even alone, the fault may be the worker's: they are
    retried (an attempt counted each time) rather than failed at once."""
    runner = harness.runner()
    job_id = seed_job(harness.db, harness.settings, n=6)
    engine = runner.engine
    prepare = engine.prepare
    broken = {"calls": 1 + 6}  # the batch, then each item alone; then it works again

    def flaky(items, sampling):
        if broken["calls"] > 0:
            broken["calls"] -= 1
            raise RuntimeError("tokenizer crashed")
        return prepare(items, sampling)

    engine.prepare = flaky  # type: ignore[method-assign]
    row = run_to_end(harness, runner, job_id)
    assert (row.status, row.succeeded) == ("completed", 6)
    attempts = {a for _, _, a in items_by_status(harness.db, job_id)["succeeded"].values()}
    assert attempts == {2}
    check_invariants(harness.db, job_id)


def test_a_huge_prompt_does_not_hold_back_the_others(harness: Harness) -> None:
    # Tokenizing costs 4 s per million characters; the big prompt is first in the claim.
    runner = harness.runner(engine_extra_args={"step_s": 0.002, "tokenize_s_per_mchar": 4.0})
    items = [{"custom_id": "big", "prompt": "placeholder"}]
    items += [{"custom_id": f"i{k}", "prompt": f"prompt {k}"} for k in range(40)]
    job_id = create_job(harness.db, harness.settings, items)
    store(harness.db, "UPDATE items SET prompt = repeat('x', 1000000) WHERE custom_id = 'big'")
    started = time.monotonic()
    thread, _ = harness.drive(runner, job_id)
    while job_row(harness.db, job_id).succeeded < 40:
        assert time.monotonic() - started < 15
        time.sleep(0.02)
    small_done = time.monotonic() - started
    big = items_by_status(harness.db, job_id)
    # Every small item went through the engine while the big one was still being tokenized.
    assert "big" in big.get("running", {}), (small_done, big)
    # The big prompt's tokenizing is a 4 s wall-clock sleep (1e6 chars x 4 s per million), which
    # load does not shorten: finishing the 40 small items in under 4 s means they went round it
    # (the `running` check above says the same from the database).
    assert small_done < 4, small_done
    thread.join(15)
    assert not thread.is_alive()
    row = wait_status(harness.db, job_id, {"completed"}, timeout=2)
    assert (row.succeeded, row.failed) == (40, 1)
    assert items_by_status(harness.db, job_id)["failed"]["big"][0] == "prompt_too_long"
    check_invariants(harness.db, job_id)


@pytest.mark.slow  # imports vLLM (and torch): ~15 s on this host
@pytest.mark.engine
def test_vllm_refusals_of_sampling_values_reject_only_their_item(settings: Settings) -> None:
    """The real adapter: vLLM's own SamplingParams judges each item; a refusal is that item's
    `invalid_request` with vLLM's message, and its batch-mates are prepared."""
    from worker.engine import ItemRejected
    from worker.engine import Prepared
    from worker.vllm_engine import VLLMEngine

    engine = VLLMEngine(settings)
    engine.max_model_len = 2048
    engine.tokenizer = lambda texts, add_special_tokens: SimpleNamespace(
        input_ids=[[7] * len(t) for t in texts]
    )
    values = [{"temperature": 3.0}, {}, {"stop": [""]}, {"top_p": 0.5}]
    items = [
        Claimed(id=k, job_id=uuid.uuid4(), seq=k, custom_id=f"i{k}", messages=None,
                prompt=f"p{k}", params=v, attempt=1, crashes=0)
        for k, v in enumerate(values)
    ]  # fmt: skip
    sampling = [resolve_sampling({}, v, default_max_tokens=16) for v in values]
    out = engine.prepare(items, sampling)
    assert [type(o) for o in out] == [ItemRejected, Prepared, ItemRejected, Prepared]
    assert out[0].code == out[2].code == "invalid_request"  # type: ignore[union-attr]
    assert "temperature" in out[0].message and "stop" in out[2].message  # type: ignore[union-attr]
