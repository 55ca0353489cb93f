"""The figures `make bench-fleet` prints against its targets (bench/fleet.py)."""

from __future__ import annotations

import pytest

from bench.fleet import fleet_ratio
from bench.fleet import lock_figures
from bench.fleet import spread
from bench.fleet import verdict


def test_the_ratio_compares_the_fleet_with_as_many_workers_alone() -> None:
    assert fleet_ratio(1440.0, 200.0, 8) == pytest.approx(0.9)
    assert fleet_ratio(1600.0, 200.0, 8) == pytest.approx(1.0)
    assert fleet_ratio(100.0, 0.0, 8) == 0.0  # no rate alone: no ratio, not a division error


def test_a_target_is_met_at_its_bound_from_either_side() -> None:
    assert verdict(0.9, 0.9) == "met"
    assert verdict(0.89, 0.9) == "NOT met"
    assert verdict(0.01, 0.01, at_most=True) == "met"
    assert verdict(0.02, 0.01, at_most=True) == "NOT met"


def test_lock_waits_as_a_share_of_samples_and_per_thousand_items() -> None:
    assert lock_figures(5, 500, 50_000) == (pytest.approx(0.01), pytest.approx(0.1))
    assert lock_figures(0, 0, 0) == (0.0, 0.0)


def test_a_spread_shows_one_value_once() -> None:
    assert spread([2.0, 2.0]) == "2.0"
    assert spread([3.3, 1.0, 2.0]) == "1.0-3.3"
    assert spread([576, 1280], "{:,.0f}") == "576-1,280"
