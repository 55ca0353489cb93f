"""The engine's scheduler load and speculative-decoding figures reach the worker's metrics:
vLLM's own per-step stats objects are fed to the stat logger the engine installs, and the
Prometheus gauges read them back."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.helpers import make_settings
from worker.engine import SchedulerLoad
from worker.metrics import metrics
from worker.runner.window import InFlight

# slow: vLLM's stats objects mean importing vLLM (and torch), ~15 s on this host. The imports
# are in the tests, so that make check, which leaves these out, never loads vLLM.
pytestmark = [pytest.mark.slow, pytest.mark.engine]


class _Runner:
    """What the metrics read of a runner."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.items_in_engine = 0
        self.window = 8
        self.inflight = InFlight(8, most=32)

    def describe(self) -> dict[str, object]:
        return {
            **dict.fromkeys(("model", "engine", "max_num_seqs", "dtype", "owner"), "x"),
            "adapters": ["a"],
        }


def _gauge(name: str) -> float:
    value = REGISTRY.get_sample_value(name)
    assert value is not None, name
    return value


def test_the_last_steps_load_and_speculation_reach_the_gauges() -> None:
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from worker.vllm_engine import VLLMEngine
    from worker.vllm_engine import _EngineStats

    settings = make_settings(
        "postgresql+psycopg://unused/x",
        "redis://unused/0",
        speculative_config={"method": "ngram", "num_speculative_tokens": 4},
    )
    engine = VLLMEngine(settings)  # not started: only its stat logger is exercised
    logger = _EngineStats(None, 0, engine=engine)
    assert engine.scheduler_load() is None
    for waiting, running, usage, accepted in ((5, 32, 0.25, 3), (2, 30, 0.5, 4)):
        # Each step looked up one new request's 100 prompt tokens and found `accepted` x 16.
        cache = PrefixCacheStats()
        cache.record(num_tokens=100, num_hits=accepted * 16, preempted=False)
        logger.record(
            SchedulerStats(
                num_running_reqs=running,
                num_waiting_reqs=waiting,
                kv_cache_usage=usage,
                prefix_cache_stats=cache,
                spec_decoding_stats=SpecDecodingStats(
                    num_spec_tokens=4,
                    num_drafts=2,
                    num_draft_tokens=8,
                    num_accepted_tokens=accepted,
                    num_accepted_tokens_per_pos=[2, 1, 0, 0],
                ),
            ),
            None,
        )
    # Two steps, of 32 and 30 running requests.
    assert engine.scheduler_load() == SchedulerLoad(
        waiting=2,
        running=30,
        kv_cache_usage=0.5,
        steps=2,
        step_requests=62,
        prefix_queries=200,
        prefix_hits=112,
    )
    metrics.watch(_Runner(engine))  # type: ignore[arg-type]
    assert _gauge("thinkbatch_worker_engine_steps_total") == 2
    assert _gauge("thinkbatch_worker_inflight_window_items") == 8  # the window at rest, read live
    assert _gauge("thinkbatch_worker_engine_step_requests_total") == 62
    assert _gauge("thinkbatch_worker_engine_waiting_requests") == 2
    assert _gauge("thinkbatch_worker_engine_running_requests") == 30
    assert _gauge("thinkbatch_worker_engine_kv_cache_usage_ratio") == 0.5
    assert _gauge("thinkbatch_worker_engine_prefix_cache_queries_total") == 200
    assert _gauge("thinkbatch_worker_engine_prefix_cache_hits_total") == 112
    assert _gauge("thinkbatch_worker_spec_decode_draft_tokens") == 16
    assert _gauge("thinkbatch_worker_spec_decode_accepted_tokens") == 7
    assert _gauge("thinkbatch_worker_spec_decode_mean_acceptance_length") == 1 + 7 / 4


def test_a_step_without_scheduler_stats_keeps_the_last_load() -> None:
    from vllm.v1.metrics.stats import SchedulerStats

    from worker.vllm_engine import VLLMEngine
    from worker.vllm_engine import _EngineStats

    engine = VLLMEngine(make_settings("postgresql+psycopg://unused/x", "redis://unused/0"))
    logger = _EngineStats(None, 0, engine=engine)
    logger.record(SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.1), None)
    logger.record(None, None)
    # The step without stats is not counted: vLLM sends stats with every step while they are on.
    assert engine.scheduler_load() == SchedulerLoad(
        waiting=0, running=1, kv_cache_usage=0.1, steps=1, step_requests=1
    )
    assert engine.speculative_stats() is None  # no speculation configured


@pytest.mark.parametrize("vllm_metrics", [False, True])
def test_vllms_own_metrics_only_when_asked(vllm_metrics: bool) -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.loggers import StatLoggerManager

    from worker.vllm_engine import VLLMEngine

    settings = make_settings(
        "postgresql+psycopg://unused/x", "redis://unused/0", vllm_metrics=vllm_metrics
    )
    loggers = VLLMEngine(settings).stat_loggers()
    before = {m.name for m in REGISTRY.collect()}
    if vllm_metrics:
        # vLLM then adds its own Prometheus logger to ours, as it does for any custom logger.
        assert not any(isinstance(f, type) and issubclass(f, PrometheusStatLogger) for f in loggers)
        return
    # As vLLM's engine builds it: with ours, it adds no Prometheus logger of its own, so no
    # `vllm:*` series reach the registry the worker's /metrics serves.
    manager = StatLoggerManager(None, custom_stat_loggers=loggers, enable_default_loggers=False)
    assert len(manager.stat_loggers) == len(loggers)
    manager.record(None, None)
    added = {m.name for m in REGISTRY.collect()} - before
    assert not {name for name in added if name.startswith("vllm:")}, added


def test_a_step_counts_the_requests_that_finished_in_it_and_an_idle_record_is_no_step() -> None:
    from vllm.v1.metrics.stats import IterationStats
    from vllm.v1.metrics.stats import SchedulerStats

    from worker.vllm_engine import VLLMEngine
    from worker.vllm_engine import _EngineStats

    engine = VLLMEngine(make_settings("postgresql+psycopg://unused/x", "redis://unused/0"))
    logger = _EngineStats(None, 0, engine=engine)
    # vLLM takes the scheduler's stats after the step: the two requests that finished in it
    # are no longer running, and are in the step's iteration stats.
    step = IterationStats()
    step.finished_requests = [object(), object()]  # type: ignore[list-item]
    logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=0), step)
    logger.record(SchedulerStats(num_running_reqs=0, num_waiting_reqs=0), IterationStats())
    logger.record(SchedulerStats(num_running_reqs=0, num_waiting_reqs=0), None)
    load = engine.scheduler_load()
    assert load is not None
    assert (load.steps, load.step_requests) == (1, 5)
