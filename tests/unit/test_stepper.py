"""The stepping thread of worker.stepper, on a synchronous engine of the test's own (vLLM's is in
tests/e2e/test_engine_death.py and every real-engine test): each request gets its own output
once, a refused request fails alone, a request given up is aborted in the engine (or never
added), and an engine that dies, while adding, while stepping or from outside, fails every
request waiting on it and every later one."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from worker.engine import EngineDead
from worker.engine import ItemRejected
from worker.stepper import Stepper


class Gone(Exception):
    """The fake engine's own "dead" error, as vLLM's EngineDeadError is the adapter's."""


class SyncEngine:
    """Each request finishes after the number of steps its payload names; a payload of "bad"
    is refused when added, one of "gone" finds the engine dead."""

    def __init__(self, step_s: float = 0.001) -> None:
        self.step_s = step_s
        self.left: dict[str, int] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.steps = 0
        self.step_error: BaseException | None = None
        self.block = threading.Event()  # set: step blocks until released
        self.release = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def step(self) -> list[Any]:
        if self.block.is_set():
            self.release.wait()
        if self.step_error is not None:
            raise self.step_error
        time.sleep(self.step_s)
        self.steps += 1
        out = []
        for rid in list(self.left):
            self.left[rid] -= 1
            finished = self.left[rid] == 0
            if finished:
                del self.left[rid]
            out.append(SimpleNamespace(request_id=rid, finished=finished, text=f"out-{rid}"))
        return out

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        for rid in request_ids:
            self.left.pop(rid, None)
            self.aborted.append(rid)


def add(engine: SyncEngine, request_id: str, payload: Any) -> None:
    if payload == "bad":
        raise ValueError("max_tokens: too many")
    if payload == "gone":
        raise Gone("the core exited")
    engine.added.append(request_id)
    engine.left[request_id] = payload


def classify(error: BaseException, payload: Any) -> BaseException:
    if isinstance(error, Gone):
        return EngineDead(str(error))
    if payload is not None and isinstance(error, ValueError):
        return ItemRejected("invalid_request", str(error))
    return error


def stepper_on(engine: SyncEngine, start: bool = True) -> Stepper:
    stepper = Stepper(engine, add=add, classify=classify)
    if start:
        stepper.start()
    return stepper


async def outcome(stepper: Stepper, rid: str, payload: Any) -> Any:
    try:
        return (await stepper.run(rid, payload)).text
    except Exception as error:  # noqa: BLE001 - the test compares what each request got
        return error


def test_every_request_gets_its_own_output_once() -> None:
    engine = SyncEngine()
    stepper = stepper_on(engine)

    async def main() -> list[Any]:
        return await asyncio.gather(*(outcome(stepper, f"r{k}", 1 + k % 7) for k in range(400)))

    assert asyncio.run(main()) == [f"out-r{k}" for k in range(400)]
    assert sorted(engine.added) == sorted(f"r{k}" for k in range(400))
    assert not engine.left and not engine.aborted
    # Requests handed in while the engine stepped joined the running batch: far fewer steps
    # than one engine pass per request.
    assert engine.steps < 100
    stepper.stop()


def test_a_refused_request_fails_alone() -> None:
    engine = SyncEngine()
    stepper = stepper_on(engine)

    async def main() -> list[Any]:
        payloads = [3, "bad", 2, "bad", 5]
        return await asyncio.gather(*(outcome(stepper, f"r{k}", p) for k, p in enumerate(payloads)))

    got = asyncio.run(main())
    assert [g for k, g in enumerate(got) if k in (0, 2, 4)] == ["out-r0", "out-r2", "out-r4"]
    for refused in (got[1], got[3]):
        assert isinstance(refused, ItemRejected) and refused.code == "invalid_request"
        assert "max_tokens: too many" in str(refused)
    assert stepper.dead is None
    stepper.stop()


def test_a_request_given_up_is_aborted_in_the_engine() -> None:
    engine = SyncEngine()
    stepper = stepper_on(engine)

    async def main() -> str:
        slow = asyncio.ensure_future(stepper.run("slow", 10_000))
        fast = asyncio.ensure_future(stepper.run("fast", 3))
        while "slow" not in engine.added:
            await asyncio.sleep(0.001)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        text: str = (await fast).text
        return text

    assert asyncio.run(main()) == "out-fast"
    deadline = time.monotonic() + 5
    while "slow" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.aborted == ["slow"] and "slow" not in engine.left
    stepper.stop()


def test_a_request_given_up_before_the_thread_took_it_is_never_added() -> None:
    engine = SyncEngine()
    stepper = stepper_on(engine, start=False)

    async def main() -> None:
        early = asyncio.ensure_future(stepper.run("early", 5))
        await asyncio.sleep(0)  # handed in
        early.cancel()
        with pytest.raises(asyncio.CancelledError):
            await early
        stepper.start()
        assert (await stepper.run("later", 2)).text == "out-later"

    asyncio.run(main())
    assert engine.added == ["later"] and engine.aborted == []
    stepper.stop()


@pytest.mark.parametrize("where", ["adding", "stepping", "outside"])
def test_a_dead_engine_fails_every_waiting_request_and_every_later_one(where: str) -> None:
    engine = SyncEngine()
    stepper = stepper_on(engine)

    async def main() -> list[Any]:
        waiting = [asyncio.ensure_future(outcome(stepper, f"r{k}", 10_000)) for k in range(20)]
        while len(engine.added) < 20:
            await asyncio.sleep(0.001)
        if where == "adding":
            waiting.append(asyncio.ensure_future(outcome(stepper, "last", "gone")))
        elif where == "stepping":
            engine.step_error = RuntimeError("output processing failed")
        else:
            # The engine's process died and the step waits for an output that never comes:
            # the adapter's watch fails the requests from its own thread.
            engine.block.set()
            await asyncio.sleep(0.05)
            stepper.fail(EngineDead("the engine core process died"))
        got = await asyncio.wait_for(asyncio.gather(*waiting), timeout=10)
        with pytest.raises(EngineDead):
            await stepper.run("after", 1)
        return got

    got = asyncio.run(main())
    assert got and all(isinstance(g, EngineDead) for g in got), got
    assert stepper.dead is not None
    engine.release.set()
    stepper.stop()
