"""Every setting of thinkbatch, read from the environment (or `.env`) in this one place.

A process builds its settings once, with `get_settings()` at its entry point (the API's
api/asgi.py and gunicorn.conf.py, the worker's worker/celery_app.py, the CLI), and passes them
down; tests build their own `Settings(...)`.
Each setting is the environment variable `THINKBATCH_<NAME>` (`THINKBATCH_DATABASE_URL`,
`THINKBATCH_MODEL`, ...), case-insensitive. The old unprefixed names (`MODEL`, `SEED`, ...) are
still read for one release, with a FutureWarning; the prefixed name wins where both are set.
"""

from __future__ import annotations

import functools
import logging
import warnings
from pathlib import Path
from typing import Any
from typing import Literal

from pydantic import Field
from pydantic import PostgresDsn
from pydantic import RedisDsn
from pydantic import UrlConstraints
from pydantic import ValidationError
from pydantic import ValidationInfo
from pydantic import ValidatorFunctionWrapHandler
from pydantic import field_validator
from pydantic import model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings
from pydantic_settings import DotEnvSettingsSource
from pydantic_settings import EnvSettingsSource
from pydantic_settings import PydanticBaseSettingsSource
from pydantic_settings import SettingsConfigDict

log = logging.getLogger(__name__)

ENV_PREFIX = "THINKBATCH_"
# The default a deployment serves when THINKBATCH_MODEL is unset: the model the product is built
# for. The tiny demo model is never a default; the dev stack (devstack/) builds and names it.
PRODUCTION_MODEL = "Qwen/Qwen3-8B"
# Old names that are no alias of ours but another program's own variable for the same thing:
# gunicorn.conf.py sets PROMETHEUS_MULTIPROC_DIR for prometheus-client, so the API's processes
# always see it. Read without a warning.
NOT_DEPRECATED = frozenset({"prometheus_multiproc_dir"})
# The most bytes one character of a string can take in JSON text: a character outside the Basic
# Multilingual Plane written as an escaped surrogate pair (`\ud83d\ude00`) is one character of
# MAX_ITEM_CHARS in twelve bytes. Byte bounds derived from character limits use this.
ESCAPED_CHAR_BYTES = 12


class LegacyNames(PydanticBaseSettingsSource):
    """The settings' old unprefixed names (`MODEL`, `DATABASE_URL`, ...) from the environment and
    the `.env` file, below the `THINKBATCH_` names in priority. Deprecated: one FutureWarning (shown
    by default, unlike a DeprecationWarning) names every old variable found and its new name."""

    def __init__(self, settings_cls: type[BaseSettings], dotenv: DotEnvSettingsSource):
        super().__init__(settings_cls)
        # The stock sources with an empty prefix parse values exactly as the prefixed ones do
        # (JSON for dicts, case-insensitive names); the environment is read over the .env file.
        self.sources: tuple[PydanticBaseSettingsSource, ...] = (
            DotEnvSettingsSource(
                settings_cls,
                env_file=dotenv.env_file,
                env_file_encoding=dotenv.env_file_encoding,
                env_prefix="",
            ),
            EnvSettingsSource(settings_cls, env_prefix=""),
        )

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads through the stock sources

    def __call__(self) -> dict[str, Any]:
        fields = self.settings_cls.model_fields
        values: dict[str, Any] = {}
        for source in self.sources:
            values.update({k: v for k, v in source().items() if k in fields})
        old = sorted(set(values) - NOT_DEPRECATED)
        if old:
            renames = ", ".join(f"{name.upper()} -> {ENV_PREFIX}{name.upper()}" for name in old)
            message = (
                f"thinkbatch settings read under their old names, deprecated and dropped in the "
                f"next release: {renames} (where both are set, the {ENV_PREFIX} name wins)"
            )
            log.warning(message)
            warnings.warn(message, FutureWarning, stacklevel=2)
        return values


class PostgresUrl(PostgresDsn):
    """PostgresDsn without its required host: libpq's socket-only URLs
    (`postgresql+psycopg:///thinkbatch?host=/run/postgresql`) are common on a database host."""

    # Subclassing with `_constraints` is how pydantic's own URL types are made; the schemes stay
    # PostgresDsn's (read from it rather than copied, so an upgrade that adds one adds it here).
    _constraints = UrlConstraints(
        host_required=False,
        allowed_schemes=PostgresDsn._constraints.allowed_schemes,  # noqa: SLF001
    )


Effort = Literal["minimal", "low", "medium", "high"]
DEFAULT_EFFORT_BUDGETS: dict[Effort, int | None] = {
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        extra="ignore",
        frozen=True,
        # A URL may carry a password: an error names the variable, never repeats its value.
        hide_input_in_errors=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        assert isinstance(dotenv_settings, DotEnvSettingsSource)
        legacy = LegacyNames(settings_cls, dotenv_settings)
        return init_settings, env_settings, dotenv_settings, legacy, file_secret_settings

    # --- services -------------------------------------------------------------------------
    database_url: PostgresUrl | None = Field(
        None,
        description="SQLAlchemy URL of PostgreSQL (postgresql+psycopg://...). Unset: the launcher "
        "starts an embedded PostgreSQL under DATA_DIR.",
    )
    redis_url: RedisDsn | None = Field(
        None, description="Redis URL of the Celery broker. Unset: the launcher starts a Redis."
    )
    data_dir: Path = Field(
        Path(".thinkbatch"), description="Where the launcher keeps embedded services and logs."
    )
    queue_name: str = Field(
        "thinkbatch",
        description="Prefix of the Celery queues: one per served name, `<QUEUE_NAME>.<name>`, "
        "consumed by the workers that serve it.",
    )

    # --- model and engine -----------------------------------------------------------------
    model: str = Field(
        PRODUCTION_MODEL,
        description="Local path or hub id of the model. The demo, bench and tests build the tiny "
        "demo Qwen3 checkpoint and pass its path here (served as 'thinkbatch-demo').",
        # Commented out in .env.example: a copied .env must not pick the model for `make demo`
        # (which would then load the production model on a CPU) nor for compose's worker.
        json_schema_extra={"env_example": "commented"},
    )
    served_model_name: str | None = Field(
        None, description="Name jobs use in `model`; defaults to MODEL."
    )
    lora_adapters: dict[str, str] = Field(
        default_factory=dict,
        description="JSON: the LoRA adapters this worker serves beside MODEL, served name to "
        "adapter directory (peft's format), loaded when the engine starts. A job or line names "
        "an adapter in `model` as it names a base model.",
    )
    max_loras: int | None = Field(
        None,
        ge=1,
        description="Adapter slots of the engine, the distinct adapters one batch may hold (vLLM's "
        "max_loras; a base-model request takes none). Unset: one more than LORA_ADAPTERS has. On "
        "the CPU backend it is raised to that at least: vLLM's CPU LoRA ops give base-model rows "
        "the last slot's adapter, so that slot must stay empty.",
    )
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank (vLLM's max_lora_rank).")
    served_models: list[str] = Field(
        default_factory=list,
        description="JSON: every served name (base model or adapter) the fleet is configured to "
        "serve. The API accepts a job for any of them, or for a name a live worker serves, and "
        "a job waits (visibly) while no worker of its model is alive. Unset: MODEL's served "
        "name and LORA_ADAPTERS'.",
    )
    engine: Literal["vllm", "fake"] = Field(
        "vllm", description="'vllm' (real engine) or 'fake' (deterministic test engine, no torch)."
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Context length. Unset: the model's, or the longest that fits in the KV cache "
        "memory (vLLM's auto-fit); the worker checks prompts against the length the engine chose.",
    )
    dtype: str = Field("auto", description="Weights dtype passed to vLLM (auto, bfloat16, ...).")
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Fraction of accelerator (CPU: host) memory vLLM may use."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine.")
    max_num_seqs: int = Field(256, ge=1, description="Sequences the engine batches per step.")
    max_num_batched_tokens: int = Field(
        8192, ge=16, description="Token budget per engine step (prefill chunking)."
    )
    enforce_eager: bool = Field(False, description="Skip graph capture/compilation (faster start).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV of shared prompt prefixes.")
    cpu_kvcache_space_gib: int | None = Field(
        None, ge=1, description="CPU backend only: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."
    )
    cpu_engine_core: Literal["auto", "compute", "reserved"] = Field(
        "auto",
        description="CPU backend only: where vLLM's engine-core (scheduler) process runs: beside "
        "the model's compute threads (`compute`), or on the cores vLLM leaves free, with this "
        "worker (`reserved`); `auto`: beside them when vLLM bound them to one core. It polls "
        "while the model computes, which on the free cores takes CPU the worker needs "
        "(worker/affinity.py).",
    )
    reasoning_parser: str = Field(
        "qwen3",
        description="vLLM's reasoning parser for the served model: a structured answer's "
        "grammar starts after the thinking it finds (`qwen3` for Qwen3 and its kin). Empty: "
        "none, and a constraint then applies from the first token.",
    )
    speculative_config: dict[str, Any] | None = Field(
        None, description="JSON passed to vLLM as speculative_config (draft model, n tokens)."
    )
    engine_extra_args: dict[str, Any] = Field(
        default_factory=dict, description="JSON of further vLLM engine arguments, passed through."
    )
    seed: int = Field(0, description="Engine seed.")

    # --- job limits -----------------------------------------------------------------------
    max_items_per_job: int = Field(100_000, ge=1, description="Items accepted in one job.")
    max_request_bytes: int = Field(
        256 * 1024 * 1024, ge=1024, description="Largest request body the API reads (413 above)."
    )
    max_json_depth: int = Field(
        32,
        ge=5,  # a message in an item's messages is level 5
        le=1000,
        description="Deepest nesting of objects and arrays in a request body (400 deeper; "
        "checked while reading, so a deep body costs no memory).",
    )
    max_prompt_chars: int = Field(
        1_000_000,
        ge=1,
        description="Most characters in one item's prompt, or its messages' contents together "
        "(400 above).",
    )
    max_messages_per_item: int = Field(
        1024,
        ge=1,
        description="Most messages in one item (or one line of a batch file); 400 above.",
    )
    max_item_chars: int = Field(
        2_000_000,
        ge=1,
        description="Most characters in all the strings of one item (or one line of a batch "
        "file), keys included: its prompt or messages and everything else (400 above). "
        "Counted while the body is read, so an item never costs more memory than this allows. "
        "Keep it above MAX_PROMPT_CHARS by what the rest of an item holds (its keys, roles, "
        "custom_id, params): at equal values a prompt of MAX_PROMPT_CHARS is refused as too large.",
    )
    max_item_values: int = Field(
        100_000,
        ge=1,
        description="Most JSON values (objects, arrays, strings, numbers, ...) in one item or "
        "line (400 above): a bound on the memory one item takes, however it is written.",
    )
    max_tokens_cap: int = Field(32768, ge=1, description="Largest `max_tokens` a job may ask for.")
    default_max_tokens: int = Field(4096, ge=1, description="`max_tokens` when a job gives none.")
    max_attempts: int = Field(3, ge=1, description="Engine attempts per item before it fails.")
    default_completion_window_s: int = Field(
        86400, ge=1, description="Seconds a job may take before unfinished items expire."
    )
    max_completion_window_s: int = Field(
        7 * 86400, ge=1, description="Largest completion_window a job may ask for."
    )

    max_choices: int = Field(
        8,
        ge=1,
        le=128,
        description="Largest `n` (choices per item) a job or line may ask for; each choice costs "
        "a full generation.",
    )
    max_grammar_chars: int = Field(
        65536,
        ge=1,
        description="Most characters of answer constraints in one params object: a schema, "
        "regex, grammar, choice list or the tools' schemas (400 above). Bounds what the "
        "engine's grammar compiler is handed.",
    )
    max_logprob_entries: int = Field(
        131072,
        ge=1,
        description="Most log probabilities one item may return: max_tokens x n x "
        "(top_logprobs + 1) must stay within it (400 above). Bounds a stored result's size.",
    )
    reasoning_effort_budgets: dict[Effort, int | None] = Field(
        default_factory=lambda: dict(DEFAULT_EFFORT_BUDGETS),
        description="JSON: the thinking budget of each `reasoning_effort` (null: no budget); "
        "`none` turns thinking off. A budget at or above an item's max_tokens does not apply.",
    )

    # --- OpenAI Files and Batches API ---------------------------------------------------------
    max_file_bytes: int = Field(
        200 * 1024 * 1024,
        ge=1,
        description="Largest file `POST /v1/files` stores (413 above); OpenAI's batch limit.",
    )
    file_chunk_bytes: int = Field(
        1024 * 1024,
        ge=1024,
        description="An uploaded file is stored as rows of this many bytes, written as it is read.",
    )
    batch_hour_s: float = Field(
        3600,
        gt=0,
        description="Seconds in one hour of a batch's `completion_window` (`24h`); only tests "
        "shorten it.",
    )
    max_batch_errors: int = Field(
        100, ge=1, description="Line errors collected before a batch's input file is refused."
    )

    # --- API server (gunicorn, see api/gunicorn.conf.py) -------------------------------------
    api_workers: int = Field(2, ge=1, description="API worker processes (gunicorn).")
    api_threads: int = Field(
        4,
        ge=1,
        description="Threads per API process that serve the quick requests (status calls, "
        "pages, listings, health): every request but the bulk ones. A request reaches a thread "
        "only once its body has arrived in full, and no thread waits for a slow reader, so a "
        "client still sending or reading holds none.",
    )
    api_bulk_threads: int = Field(
        4,
        ge=1,
        description="Threads per API process that serve the bulk requests, whose work grows "
        "with a job or a file: results downloads, file contents, a job's timeline, batch "
        "creates and requests with a body over 256 KiB (a large submit, an upload). The quick "
        "requests never wait for these threads.",
    )
    api_max_connections: int = Field(
        1000,
        ge=1,
        description="Open connections per API process (gunicorn's worker_connections): idle, "
        "sending a body or being served. A connection beyond it is closed as it comes.",
    )
    request_header_timeout_s: float = Field(
        30,
        gt=0,
        description="Longest a new connection may take to send its first request's line and "
        "headers before it is closed; a kept-alive connection's next request has "
        "API_KEEPALIVE_S.",
    )
    api_keepalive_s: int = Field(
        75,
        ge=1,
        description="Longest an idle kept-alive connection waits for its next request before "
        "the API closes it. Longer than the idle timeouts of clients' and proxies' connection "
        "pools (httpx 5 s, aiohttp 15 s, nginx's and AWS ALB's 60 s): a pool that reuses a "
        "connection just as the server closes it gets no answer, and a POST is not retried.",
    )
    api_loop_stall_s: float = Field(
        2,
        gt=0,
        description="An API process whose event loop has not run for this long logs where it "
        "stands (api/stall.py): every connection of the process waits while it does.",
    )
    request_read_timeout_s: float = Field(
        30,
        gt=0,
        description="Longest a request body may go without any bytes arriving (408 after).",
    )
    request_min_bytes_per_s: int = Field(
        4096,
        ge=1,
        description="After REQUEST_READ_TIMEOUT_S, a request body (Content-Length or chunked) "
        "must have arrived at this rate on average (408 otherwise): the time a client may take "
        "grows only with the bytes it has sent, never with the size it declares.",
    )
    max_uploads_per_client: int = Field(
        8,
        ge=1,
        description="Request bodies one client address may be sending to one API process at "
        "once (429 beyond). Behind a proxy every client has the proxy's address: raise it there.",
    )
    spool_memory_bytes: int = Field(
        1024 * 1024,
        ge=0,
        description="A request body is received in full before it is served: in memory up to "
        "this size, in a temporary file beyond.",
    )
    response_spool_max_bytes: int = Field(
        1024**3,
        ge=0,
        description="Bytes of responses (a results download) one API process may hold in "
        "temporary files for clients that read them slower than they are made, so that no "
        "request thread waits for a slow client; past it, a response waits for its client.",
    )
    response_write_timeout_s: float = Field(
        60,
        gt=0,
        description="Longest a client may leave a response's bytes unacknowledged, or take "
        "none of them, before its connection is dropped (TCP_USER_TIMEOUT on the API's TCP "
        "sockets).",
    )

    # --- security and quotas ---------------------------------------------------------------
    auth_required: bool = Field(
        True,
        description="Require an API key (`Authorization: Bearer <key>`) on every route but "
        "/healthz, /readyz and /metrics. Turn off only for local single-user use: every caller "
        "is then the tenant 'default'.",
    )
    auth_failures_per_minute: int = Field(
        20,
        ge=1,
        description="Failed authentications per client address per minute before 429 (each "
        "API process may let one more attempt through, or as many as it serves at once, before "
        "it sees another's count).",
    )
    tenant_max_unfinished_items: int = Field(
        1_000_000,
        ge=1,
        description="Most pending and running items one tenant may have across its jobs (429).",
    )
    tenant_jobs_per_minute: int = Field(
        60, ge=1, description="Most jobs one tenant may submit in any 60 seconds (429)."
    )
    tenant_max_jobs_per_worker: int = Field(
        4,
        ge=1,
        description="Jobs of one tenant a worker drives at once (of WORKER_CONCURRENCY task "
        "threads), so that another tenant's job always finds one; the engine is shared between "
        "tenants equally, then by priority within a tenant.",
    )

    # --- timeouts (they nest; see check_timeouts) -------------------------------------------
    item_deadline_s: float = Field(
        1800, gt=0, description="Longest an item may stay in the engine before it is aborted."
    )
    lease_s: float = Field(
        2400, gt=0, description="Claim lease of an item; others may retry it once it lapses."
    )
    visibility_timeout_s: float = Field(
        7200, gt=0, description="Redis redelivers an unacknowledged task message after this."
    )
    task_slice_s: float = Field(
        300, gt=0, description="A job task claims for this long, then hands the job on."
    )
    heartbeat_s: float = Field(5, gt=0, description="Worker heartbeat period.")
    worker_dead_after_s: float = Field(
        30, gt=0, description="A worker silent this long is dead; its items are retried."
    )
    sweep_interval_s: float = Field(10, gt=0, description="Period of the recovery sweeper.")
    hint_stale_s: float = Field(
        60, gt=0, description="Re-enqueue a job with pending items and no sign of life this long."
    )
    shutdown_timeout_s: float = Field(
        30, gt=0, description="After SIGTERM the worker exits within this, releasing its items."
    )

    # --- worker ---------------------------------------------------------------------------
    worker_concurrency: int = Field(
        8, ge=1, description="Jobs one worker drives at once (Celery threads)."
    )
    inflight_factor: float = Field(
        2.0, ge=1, description="Items kept in the engine = inflight_factor x MAX_NUM_SEQS."
    )
    # The window grows past INFLIGHT_FACTOR only while the engine finishes items faster than
    # that window holds for INFLIGHT_LOOKAHEAD_S (short items on a fast engine): a refill then
    # lands before the engine's queue runs dry. A job may use the grown window only as far as
    # its own items' rate calls for; one whose items are slower keeps to INFLIGHT_FACTOR's.
    # The rate is measured on items that finished, so a job whose later items are much longer
    # than its first can lease up to the grown window of them until the rate falls (tenths of
    # a second).
    inflight_max_factor: float = Field(
        8.0,
        ge=1,
        description="Most items kept in the engine = inflight_max_factor x MAX_NUM_SEQS, "
        "reached only while the engine finishes items fast (INFLIGHT_LOOKAHEAD_S).",
    )
    inflight_lookahead_s: float = Field(
        0.25,
        ge=0,
        description="Seconds of the engine's output the window holds, within INFLIGHT_FACTOR "
        "and INFLIGHT_MAX_FACTOR (0: a fixed INFLIGHT_FACTOR window).",
    )
    # A fleet's idle workers join a new job through these messages at once; past them, they
    # adopt it on their next heartbeat, seconds later (make bench-fleet: 8 workers on one job).
    # A worker already driving the job drops an extra message at once.
    job_fanout: int = Field(
        16, ge=1, description="Most task messages for one job, so that several workers share it."
    )
    fanout_items: int = Field(
        256, ge=1, description="A new job gets a task message per this many items (to JOB_FANOUT)."
    )
    # vLLM's prefix cache keeps a shared beginning while it fits: items that share one run
    # cheaper back to back (thinkbatch/jobs/prefix.py). `submitted`: the job's own order.
    claim_order: Literal["prefix", "submitted"] = Field(
        "prefix",
        description="The order a job's items are claimed in: `prefix` puts together the items "
        "whose prompts begin alike, so the engine's prefix cache serves them; `submitted` "
        "keeps the job's order.",
    )
    write_interval_s: float = Field(
        0.2,
        gt=0,
        description="Longest a finished result waits in the writer to be stored with others "
        "(stored at once when the engine holds nothing more).",
    )
    write_batch_max: int = Field(1000, ge=1, description="Most results per writer transaction.")
    prepare_inline_max_chars: int = Field(
        20_000,
        ge=0,
        description="A prompt longer than this (characters) is rendered and tokenized on a side "
        "thread, so that it never delays the other items' way to the engine.",
    )
    db_pool_size: int = Field(
        5,
        ge=1,
        description="SQLAlchemy pool size per process, and as many more at a peak. An API "
        "process pools API_THREADS + API_BULK_THREADS at least (a connection for each request "
        "thread), and this many more at a peak.",
    )
    db_ping_after_idle_s: float = Field(
        1.0,
        ge=0,
        description="A pooled connection idle for longer than this is pinged (a round trip) "
        "before use; one used more recently is only checked for a word from the server (a "
        "restart or a terminated session is found either way). 0: ping before every use, for "
        "a path that drops idle sessions silently (a proxy, a NAT).",
    )
    analyze_after_items: int = Field(
        10_000,
        ge=0,
        description="A job of at least this many items has the items table's planner "
        "statistics refreshed (ANALYZE) once it is stored, off the submit's path, so that its "
        "pages are planned as the large job it is (0: never; autovacuum alone may take "
        "minutes to notice).",
    )

    # --- operations: metrics and logs ------------------------------------------------------
    worker_metrics_port: int = Field(
        9101,
        ge=0,
        le=65535,
        description="Port of a worker's Prometheus /metrics (0: off). One per worker process: "
        "give each worker on a host its own, or 0 where several start at once.",
    )
    vllm_metrics: bool = Field(
        False,
        description="Also serve vLLM's own Prometheus metrics (vllm:*, about a hundred series: "
        "latency histograms per request) on the worker's /metrics. Off by default: recording "
        "them takes CPU from the engine's frontend on every step; thinkbatch's own engine "
        "gauges are served either way.",
    )
    worker_metrics_host: str = Field(
        "127.0.0.1",
        description="Address the worker's metrics port listens on (0.0.0.0 in a container).",
    )
    prometheus_multiproc_dir: Path | None = Field(
        None,
        description="Directory where the API's gunicorn processes share metrics (wiped at "
        "start). Unset: a fresh temporary directory per API start.",
    )
    log_format: Literal["json", "text"] = Field(
        "json", description="Log lines of the API and the worker: JSON lines, or plain text."
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level logged by the API and the worker."
    )

    @field_validator("database_url", "redis_url", mode="wrap")
    @classmethod
    def name_the_variable(
        cls, value: object, handler: ValidatorFunctionWrapHandler, info: ValidationInfo
    ) -> object:
        # pydantic names the field; a deployment sets the variable.
        try:
            return handler(value)
        except ValidationError as error:
            name = f"{ENV_PREFIX}{(info.field_name or '').upper()}"
            reason = "; ".join(e["msg"] for e in error.errors())
            raise ValueError(f"{name} is not a valid URL for it: {reason}") from None

    @model_validator(mode="after")
    def check_timeouts(self) -> Settings:
        # An item must finish (or be aborted) before its lease lapses, and Redis must not hand a
        # task message to another worker while a live worker still holds its items.
        if not self.item_deadline_s < self.lease_s < self.visibility_timeout_s:
            raise ValueError(
                "timeouts must nest: ITEM_DEADLINE_S < LEASE_S < VISIBILITY_TIMEOUT_S "
                f"(got {self.item_deadline_s} < {self.lease_s} < {self.visibility_timeout_s})"
            )
        # A job task runs for at most one slice plus the drain of what it holds.
        if self.task_slice_s + self.item_deadline_s >= self.visibility_timeout_s:
            raise ValueError("TASK_SLICE_S + ITEM_DEADLINE_S must be < VISIBILITY_TIMEOUT_S")
        if self.heartbeat_s * 2 > self.worker_dead_after_s:
            raise ValueError("WORKER_DEAD_AFTER_S must be at least twice HEARTBEAT_S")
        if self.max_prompt_chars > self.max_item_chars:
            raise ValueError("MAX_PROMPT_CHARS must not exceed MAX_ITEM_CHARS")
        # An adapter under the base model's name would take every item of the base model (and
        # every item naming none), and the base model could no longer be reached.
        if self.model_name in self.lora_adapters:
            raise ValueError(
                f"LORA_ADAPTERS: {self.model_name!r} is the base model's served name "
                "(SERVED_MODEL_NAME, else MODEL); give the adapter a name of its own"
            )
        for name in self.lora_adapters:
            if not name or name != name.strip():
                raise ValueError(
                    f"LORA_ADAPTERS: {name!r} is not a served name (empty, or with spaces "
                    "around it, no job could name it)"
                )
        if self.default_max_tokens > self.max_tokens_cap:
            raise ValueError("DEFAULT_MAX_TOKENS must not exceed MAX_TOKENS_CAP")
        if any(b is not None and b < 1 for b in self.reasoning_effort_budgets.values()):
            raise ValueError("REASONING_EFFORT_BUDGETS: each budget is null or at least 1")
        if self.inflight_max_factor < self.inflight_factor:
            raise ValueError(
                "INFLIGHT_MAX_FACTOR must be at least INFLIGHT_FACTOR "
                f"(got {self.inflight_max_factor} < {self.inflight_factor})"
            )
        return self

    @property
    def model_name(self) -> str:
        """The name jobs refer to the served model by."""
        return self.served_model_name or self.model

    @property
    def served_names(self) -> list[str]:
        """What this worker serves: its base model's name, then its adapters'."""
        return [self.model_name, *self.lora_adapters]

    @property
    def configured_models(self) -> list[str]:
        """What the fleet is configured to serve (SERVED_MODELS, else this host's names)."""
        return list(self.served_models) or self.served_names

    @property
    def max_line_bytes(self) -> int:
        """The longest batch-file line read: an item within the item limits, written without
        padding, takes at most ESCAPED_CHAR_BYTES per character and 64 bytes per other value.
        Longer lines are refused unread, so a file without line breaks costs no more memory
        than one item. (Whitespace and a number's digits count toward no item limit: a line
        padded past this is refused though its item is within them.)"""
        return ESCAPED_CHAR_BYTES * self.max_item_chars + 64 * self.max_item_values

    @property
    def inflight_window(self) -> int:
        """The in-flight window's size at rest (INFLIGHT_FACTOR)."""
        return max(1, int(self.inflight_factor * self.max_num_seqs))

    @property
    def inflight_window_most(self) -> int:
        """The most the window grows to for an engine that finishes items fast."""
        return max(self.inflight_window, int(self.inflight_max_factor * self.max_num_seqs))

    # The URLs leave as plain strings: SQLAlchemy, Celery and redis-py take them so.
    def require_database_url(self) -> str:
        if self.database_url is None:
            raise RuntimeError(
                f"{ENV_PREFIX}DATABASE_URL is not set (the demo launcher sets it for you)"
            )
        return str(self.database_url)

    def require_redis_url(self) -> str:
        if self.redis_url is None:
            raise RuntimeError(
                f"{ENV_PREFIX}REDIS_URL is not set (the demo launcher sets it for you)"
            )
        return str(self.redis_url)


@functools.cache
def get_settings() -> Settings:
    """This process's settings, read from the environment once (a forked process keeps its
    parent's)."""
    return Settings()
