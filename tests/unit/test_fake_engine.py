"""The test engine's scheduler figures: the benchmark's ceiling and the fast tests read its steps
and batches as they read vLLM's (worker/metrics.py), so they must add up."""

from __future__ import annotations

import asyncio
import math
import uuid

from tests.helpers import make_settings
from thinkbatch.ledger import Claimed
from thinkbatch.sampling import resolve_sampling
from worker.engine import Generation
from worker.engine import create_engine


def test_the_fake_engine_counts_its_steps_and_the_requests_each_ran() -> None:
    settings = make_settings(
        "postgresql+psycopg://unused/x",
        "redis://unused/0",
        max_num_seqs=4,
        engine_extra_args={"step_s": 0},
    )
    engine = create_engine(settings)
    items = [
        Claimed(k, uuid.uuid4(), k, f"c{k}", None, f"question {k}", None, 1, 0) for k in range(10)
    ]
    sampling = [
        resolve_sampling({"max_tokens": 5, "ignore_eos": True}, None, default_max_tokens=5)
    ] * len(items)

    async def run() -> list[Generation]:
        await engine.start()
        try:
            prepared = engine.prepare(items, sampling)
            return await asyncio.gather(
                *(engine.generate(f"r{k}", p) for k, p in enumerate(prepared))  # type: ignore[arg-type]
            )
        finally:
            await engine.shutdown()

    outs = asyncio.run(run())
    load = engine.scheduler_load()
    assert load is not None
    tokens = sum(len(o.token_ids) for o in outs)
    assert tokens == 10 * 5
    # A running request makes one token a step: the requests summed over the steps are the
    # tokens made.
    assert load.step_requests == tokens
    # All ten wait before the first step: batches of 4, 4 and 2, each running 5 steps.
    assert load.steps == 3 * 5 == math.ceil(10 / 4) * 5
    assert load.waiting == 0 and load.running == 0
