"""The worker's stage accounting (worker/stages.py): CPU is charged to the stage that spent it,
and the timing wrapper behaves like a plain `await` (value, errors, cancellation)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.helpers import burn_cpu
from worker.stages import STAGES
from worker.stages import StageClock
from worker.stages import Timed
from worker.stages import thread_cpu


def test_measure_charges_the_threads_cpu_not_its_waiting() -> None:
    clock = StageClock()
    with clock.measure("claim"):
        burn_cpu(0.05)
    with clock.measure("store"):
        time.sleep(0.1)  # waiting (on Postgres, say) is no CPU
    cpu = clock.snapshot()
    assert set(cpu) == set(STAGES)
    assert 0.05 <= cpu["claim"] < 0.5
    assert cpu["store"] < 0.02


def test_timed_charges_the_first_step_to_submit_and_the_rest_to_output() -> None:
    clock = StageClock()

    async def request() -> str:
        burn_cpu(0.04)  # into the engine
        await asyncio.sleep(0.05)  # the engine works; another task burns meanwhile
        burn_cpu(0.02)  # taking the output
        return "generation"

    async def neighbour() -> None:
        await asyncio.sleep(0.01)
        burn_cpu(0.1)  # runs while the request is suspended: charged to nobody

    async def main() -> str:
        result, _ = await asyncio.gather(Timed(request(), "submit", "output", clock), neighbour())
        return result

    assert asyncio.run(main()) == "generation"
    cpu = clock.snapshot()
    assert 0.04 <= cpu["submit"] < 0.09
    assert 0.02 <= cpu["output"] < 0.07


def test_a_sample_counts_for_its_weight() -> None:
    clock = StageClock()

    async def request() -> None:
        burn_cpu(0.02)

    asyncio.run(_await(Timed(request(), "submit", "output", clock, weight=4)))
    assert 0.08 <= clock.snapshot()["submit"] < 0.3


async def _await(awaitable: Timed) -> None:
    await awaitable


def test_timed_passes_errors_and_cancellation_through() -> None:
    clock = StageClock()
    seen: list[str] = []

    async def failing() -> None:
        await asyncio.sleep(0)
        raise ValueError("refused")

    async def hanging() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled inside")  # the engine adapter aborts its request here
            raise

    async def hanging_timed() -> None:
        await Timed(hanging(), "submit", "output", clock)

    async def main() -> None:
        with pytest.raises(ValueError, match="refused"):
            await Timed(failing(), "submit", "output", clock)
        task = asyncio.create_task(hanging_timed())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert task.cancelled()

    asyncio.run(main())
    assert "cancelled inside" in seen


def test_thread_cpu_names_the_threads() -> None:
    burned, done = threading.Event(), threading.Event()

    def work() -> None:
        burn_cpu(0.05)
        burned.set()
        done.wait()

    thread = threading.Thread(target=work, name="writer")
    thread.start()
    try:
        assert burned.wait(30)
        cpu = thread_cpu()
        assert cpu["writer"] >= 0.05
        assert "MainThread" in cpu
    finally:
        done.set()
        thread.join()
