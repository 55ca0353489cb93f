"""The API's event-loop watchdog (api/stall.py) logs the loop's stack while it is blocked, and
how long it stood still once it runs again; a loop that keeps running logs nothing."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from api.stall import LoopWatchdog


def _blocking_call_on_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # what a synchronous call on the loop does to every connection


async def _run(watchdog: LoopWatchdog, block_s: float, then_s: float) -> None:
    watchdog.start()
    await asyncio.sleep(0.3)
    if block_s:
        _blocking_call_on_the_loop(block_s)
    await asyncio.sleep(then_s)
    watchdog.stop()


def _watched(
    caplog: pytest.LogCaptureFixture, threshold_s: float, block_s: float, then_s: float
) -> list[str]:
    """What the watchdog logs over a loop that runs, blocks for `block_s`, then runs on."""
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.WARNING, logger="thinkbatch.api.loop"):
            watchdog = LoopWatchdog(loop, threshold_s)
            loop.run_until_complete(_run(watchdog, block_s=block_s, then_s=then_s))
    finally:
        loop.close()
    return [r.getMessage() for r in caplog.records]


def test_a_blocked_loop_is_logged_with_where_it_stands(caplog: pytest.LogCaptureFixture) -> None:
    messages = _watched(caplog, 0.2, block_s=1.0, then_s=0.5)
    assert len(messages) == 2, messages
    assert "has not run for" in messages[0]
    assert "_blocking_call_on_the_loop" in messages[0]  # the stack names the blocking call
    ran_again = float(messages[1].split("after ")[1].split(" s")[0])
    assert 0.8 <= ran_again <= 1.5, messages[1]


def test_a_running_loop_logs_nothing(caplog: pytest.LogCaptureFixture) -> None:
    assert _watched(caplog, 0.5, block_s=0, then_s=1.0) == []
