"""The ceiling's CPU bound that `make bench` prints: the pipeline's processes only."""

from __future__ import annotations

import pytest

from bench.cpu import pipeline_bound


def test_the_bound_sums_the_pipeline_processes_and_spreads_them_over_the_cores() -> None:
    round_cpu = {
        "cpu": {"worker": 2.2, "postgres": 2.4, "api": 0.3, "redis": 0.01, "engine": 0.0,
                "bench": 0.5, "raw client": 0.7}  # the client's and the raw arm's: not counted
    }  # fmt: skip
    per_item, bound = pipeline_bound(round_cpu, 20_000, cores=2)
    assert per_item == pytest.approx(245.5)
    assert bound == pytest.approx(2 / 245.5e-6)


def test_no_cpu_means_no_bound() -> None:
    assert pipeline_bound({"cpu": {}}, 10, cores=2) == (0.0, float("inf"))
