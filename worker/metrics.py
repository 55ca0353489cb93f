"""Prometheus metrics of a worker process, served on its own port (WORKER_METRICS_PORT).

A worker is one process (a threads pool, never prefork), so the default registry is enough:
no multiprocess mode here, unlike the API under gunicorn. Counters count what the writer
actually stored (the fenced writes' answer), so they match the jobs' counts in Postgres.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Collection
from collections.abc import Mapping
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import Protocol

from prometheus_client import Counter
from prometheus_client import Gauge
from prometheus_client import Histogram
from prometheus_client import Info
from prometheus_client import start_http_server
from prometheus_client.core import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from thinkbatch.ledger import Done
from thinkbatch.ledger import Failed
from thinkbatch.settings import Settings
from worker import stages

if TYPE_CHECKING:
    from worker.engine import Engine


class Window(Protocol):
    size: int


class Watched(Protocol):
    """What the metrics read of a runner when scraped (worker/runner/core.py `Runner`): the
    metrics are a leaf the runner's parts report to, so they name no part of the runner."""

    @property
    def engine(self) -> Engine: ...

    @property
    def inflight(self) -> Window: ...

    @property
    def items_in_engine(self) -> int: ...

    def describe(self) -> dict[str, Any]: ...


log = logging.getLogger(__name__)

# Seconds an item spends in each phase: a reasoning model's answer takes seconds to minutes.
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
RATE_WINDOW_S = 30.0


class WorkerMetrics:
    def __init__(self) -> None:
        self.succeeded = Counter(
            "thinkbatch_worker_items_succeeded", "Items this worker stored as succeeded."
        )
        self.failed = Counter(
            "thinkbatch_worker_items_failed",
            "Items this worker stored as failed for good, by error code.",
            ["code"],
        )
        self.retried = Counter(
            "thinkbatch_worker_items_retried",
            "Item attempts that failed here and went back to the queue, by error code.",
            ["code"],
        )
        self.fenced_writes = Counter(
            "thinkbatch_worker_fenced_writes",
            "Writes of this worker that the fence refused because the item's lease had passed "
            "on (it lapsed, or this worker was judged dead and its items were released), by "
            "kind: result, failure, end (of a cancelled or expired job's item), release.",
            ["kind"],
        )
        for kind in ("result", "failure", "end", "release"):
            self.fenced_writes.labels(kind)
        self.tokens = Counter(
            "thinkbatch_worker_tokens",
            "Tokens of the items this worker stored as succeeded, by kind "
            "(prompt, completion, reasoning; reasoning tokens are part of completion).",
            ["kind"],
        )
        for kind in ("prompt", "completion", "reasoning"):
            self.tokens.labels(kind)
        self.latency = Histogram(
            "thinkbatch_worker_item_latency_seconds",
            "Item latency by phase: queued (job created to engine), engine (in the engine), "
            "total (job created to out of the engine).",
            ["phase"],
            buckets=LATENCY_BUCKETS,
        )
        # Bound once: a labels() lookup per item cost more than the observation.
        self._phases = tuple(self.latency.labels(p) for p in ("engine", "queued", "total"))
        self.in_engine = Gauge(
            "thinkbatch_worker_items_in_engine", "Items handed to the engine, not yet back."
        )
        self.window = Gauge(
            "thinkbatch_worker_inflight_window_items",
            "Most items this worker keeps in flight now (INFLIGHT_FACTOR, more while the engine "
            "finishes items fast).",
        )
        # By the worker's base model: what a fleet's dashboards group workers by.
        self.tokens_per_s = Gauge(
            "thinkbatch_worker_completion_tokens_per_second",
            f"Completion tokens stored per second over the last {RATE_WINDOW_S:g} s, by the "
            "worker's model.",
            ["model"],
        )
        self.items_per_s = Gauge(
            "thinkbatch_worker_items_per_second",
            f"Items stored as succeeded per second over the last {RATE_WINDOW_S:g} s, by the "
            "worker's model.",
            ["model"],
        )
        # The engine's own scheduler, at its last step (vLLM's scheduler stats).
        self.engine_waiting = Gauge(
            "thinkbatch_worker_engine_waiting_requests",
            "Requests waiting in the engine's scheduler for a batch slot.",
        )
        self.engine_running = Gauge(
            "thinkbatch_worker_engine_running_requests",
            "Requests in the engine's running batch.",
        )
        self.kv_cache_usage = Gauge(
            "thinkbatch_worker_engine_kv_cache_usage_ratio",
            "Fraction of the engine's KV cache in use (0-1).",
        )
        # Speculative decoding since the engine started (0 when it is off).
        self.spec_draft_tokens = Gauge(
            "thinkbatch_worker_spec_decode_draft_tokens",
            "Tokens drafted by speculative decoding since the engine started.",
        )
        self.spec_accepted_tokens = Gauge(
            "thinkbatch_worker_spec_decode_accepted_tokens",
            "Drafted tokens the target model accepted since the engine started.",
        )
        self.spec_acceptance_length = Gauge(
            "thinkbatch_worker_spec_decode_mean_acceptance_length",
            "Tokens produced per verification step (1 + accepted / drafts).",
        )
        self.info = Info("thinkbatch_worker", "Model and engine this worker serves.")
        self._recent: collections.deque[tuple[float, int, int]] = collections.deque()
        self.engine: Engine | None = None  # the watched runner's, read by EngineStepsCollector
        self._lock = threading.Lock()

    def rates_for(self, model: str) -> None:
        """The rates, labelled with the model this worker serves (once it is known)."""
        self.tokens_per_s.labels(model).set_function(lambda: self._rate(1))
        self.items_per_s.labels(model).set_function(lambda: self._rate(2))

    def _rate(self, index: int) -> float:
        cutoff = time.monotonic() - RATE_WINDOW_S
        with self._lock:
            while self._recent and self._recent[0][0] < cutoff:
                self._recent.popleft()
            return sum(entry[index] for entry in self._recent) / RATE_WINDOW_S

    def left_engine(self, kind: str, engine_s: float, queued_s: float | None) -> None:
        """An item came out of the engine (the runner settles it)."""
        if kind != "done":
            return
        engine, queued, total = self._phases
        engine.observe(engine_s)
        if queued_s is not None:
            queued.observe(queued_s)
            total.observe(queued_s + engine_s)

    def stored(
        self,
        done: Sequence[Done],
        failed: Sequence[Failed],
        stored_done: Collection[int],
        failed_status: Mapping[int, str],
    ) -> None:
        """The writer stored a batch: count what the fenced writes accepted."""
        kept = [d for d in done if d.item_id in stored_done]
        completion = sum(d.completion_tokens for d in kept)
        self.tokens.labels("prompt").inc(sum(d.prompt_tokens for d in kept))
        self.tokens.labels("completion").inc(completion)
        self.tokens.labels("reasoning").inc(sum(d.reasoning_tokens for d in kept))
        self.succeeded.inc(len(kept))
        for f in failed:
            status = failed_status.get(f.item_id)
            if status == "failed":
                self.failed.labels(f.code).inc()
            elif status == "pending":
                self.retried.labels(f.code).inc()
        with self._lock:
            self._recent.append((time.monotonic(), completion, len(kept)))

    def fenced(self, by_kind: Mapping[str, int]) -> None:
        """The writer's late writes that the fence refused, by kind."""
        for kind, n in by_kind.items():
            if n:
                self.fenced_writes.labels(kind).inc(n)

    def watch(self, runner: Watched) -> None:
        """Read the runner's load when scraped."""
        self.in_engine.set_function(lambda: runner.items_in_engine)
        engine = self.engine = runner.engine

        def load(field: str) -> float:
            current = engine.scheduler_load()
            return float(getattr(current, field)) if current is not None else 0.0

        def spec(field: str) -> float:
            current = engine.speculative_stats()
            value = getattr(current, field) if current is not None else None
            return float(value or 0.0)

        self.engine_waiting.set_function(lambda: load("waiting"))
        self.engine_running.set_function(lambda: load("running"))
        self.kv_cache_usage.set_function(lambda: load("kv_cache_usage"))
        self.spec_draft_tokens.set_function(lambda: spec("draft_tokens"))
        self.spec_accepted_tokens.set_function(lambda: spec("accepted_tokens"))
        self.spec_acceptance_length.set_function(lambda: spec("acceptance_length"))
        inflight = runner.inflight
        self.window.set_function(lambda: inflight.size)
        described = runner.describe()
        info = {k: str(described[k]) for k in ("model", "engine", "max_num_seqs", "dtype", "owner")}
        self.info.info({**info, "adapters": ",".join(described["adapters"])})


class CpuCollector(Collector):
    """CPU seconds by stage (worker/stages.py), by Python thread, and the process's
    total, read when scraped."""

    def collect(self) -> Any:
        stage = CounterMetricFamily(
            "thinkbatch_worker_stage_cpu_seconds",
            "Thread CPU seconds spent in each stage of the items' way through this worker.",
            labels=["stage"],
        )
        for name, seconds in stages.clock.snapshot().items():
            stage.add_metric([name], seconds)
        yield stage
        thread = CounterMetricFamily(
            "thinkbatch_worker_thread_cpu_seconds",
            "CPU seconds of each live Python thread of this worker process, by name.",
            labels=["thread"],
        )
        for name, seconds in stages.thread_cpu().items():
            thread.add_metric([name], seconds)
        yield thread
        yield CounterMetricFamily(
            "thinkbatch_worker_process_cpu_seconds",
            "CPU seconds of this worker process, all its threads.",
            value=time.process_time(),
        )


class EngineStepsCollector(Collector):
    """The engine's steps and the requests each step ran, summed, as counters: over any
    interval their ratio is the mean batch the engine ran, which says whether the worker keeps
    it full (`make bench` prints it for the raw engine and the job system side by side). And
    its prefix cache's queries and hits, whose ratio is the hit rate (`make bench-prefix`)."""

    def collect(self) -> Any:
        load = metrics.engine.scheduler_load() if metrics.engine is not None else None
        yield CounterMetricFamily(
            "thinkbatch_worker_engine_steps",
            "Steps the engine has run since it started.",
            value=load.steps if load is not None else 0,
        )
        yield CounterMetricFamily(
            "thinkbatch_worker_engine_step_requests",
            "Requests each engine step ran, summed over the steps (divided by the steps: the "
            "mean batch).",
            value=load.step_requests if load is not None else 0,
        )
        # Prompt tokens, as vLLM's own vllm:prefix_cache_queries and _hits count them.
        yield CounterMetricFamily(
            "thinkbatch_worker_engine_prefix_cache_queries",
            "Prompt tokens the engine looked up in its prefix cache since it started.",
            value=load.prefix_queries if load is not None else 0,
        )
        yield CounterMetricFamily(
            "thinkbatch_worker_engine_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache since it started (divided by "
            "the queries: the hit rate).",
            value=load.prefix_hits if load is not None else 0,
        )


metrics = WorkerMetrics()
REGISTRY.register(CpuCollector())
REGISTRY.register(EngineStepsCollector())


def serve(settings: Settings, runner: Watched) -> Any:
    """Serve /metrics on WORKER_METRICS_PORT (0: off). A port in use is logged, not fatal:
    losing the metrics must not cost a loaded engine."""
    metrics.watch(runner)
    metrics.rates_for(settings.model_name)
    if not settings.worker_metrics_port:
        return None
    try:
        server, _thread = start_http_server(
            settings.worker_metrics_port, addr=settings.worker_metrics_host
        )
    except OSError as error:
        log.error(
            "worker metrics not served on %s:%d: %s",
            settings.worker_metrics_host,
            settings.worker_metrics_port,
            error,
        )
        return None
    log.info(
        "worker metrics on http://%s:%d/metrics",
        settings.worker_metrics_host,
        settings.worker_metrics_port,
    )
    return server
