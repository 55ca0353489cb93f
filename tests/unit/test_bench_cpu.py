"""bench/cpu.py counts an embedded Postgres's backends that came and went between two
snapshots once, from the postmaster's reaped children: those that started after the first
snapshot in full, those alive at it for what they used after it."""

from __future__ import annotations

import pytest

from bench import cpu


def test_a_reaped_backend_counts_what_it_used_in_between(monkeypatch: pytest.MonkeyPatch) -> None:
    reaped = cpu.REAPED
    before = {
        10: ("postgres", 1.0),  # the postmaster
        -10: (reaped, 5.0),
        11: ("postgres", 2.0),  # a backend that exits in between, having used 2.5 in all
        20: ("worker", 3.0),
    }
    now = {
        10: ("postgres", 1.1),
        # 11 (2.5 in all) and 13, which started and exited in between (0.4), were reaped.
        -10: (reaped, 5.0 + 2.5 + 0.4),
        12: ("postgres", 0.3),  # started in between, still alive
        20: ("worker", 3.5),
    }
    monkeypatch.setattr(cpu, "cpu_snapshot", lambda database="": now)
    used = cpu.cpu_used(before)
    assert used["postgres"] == pytest.approx(0.1 + 0.5 + 0.4 + 0.3)
    assert used["worker"] == pytest.approx(0.5)
    assert set(used) == {"postgres", "worker"}


def test_a_shared_postgres_counts_only_its_live_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    # Not ours: no postmaster, so a backend gone in between is not subtracted (its time is
    # nowhere in the second snapshot).
    before = {11: ("postgres", 2.0), 12: ("postgres", 1.0)}
    now = {12: ("postgres", 1.5)}
    monkeypatch.setattr(cpu, "cpu_snapshot", lambda database="": now)
    assert cpu.cpu_used(before) == {"postgres": pytest.approx(0.5)}
