"""Wire formats of the REST API, as pydantic models.

Inputs forbid unknown fields and coerce nothing (`strict`), so a typo or a number sent as a
string is a 400 that names the field instead of a silently ignored setting.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated
from typing import Any
from typing import Literal

from pydantic import AfterValidator
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from thinkbatch.jobs.asks import ReasoningEffort
from thinkbatch.jobs.asks import ResponseFormat
from thinkbatch.jobs.asks import StructuredOutputs
from thinkbatch.jobs.asks import ToolChoice
from thinkbatch.jobs.asks import Tools
from thinkbatch.limits import LOGIT_BIAS_MAX
from thinkbatch.limits import LOGIT_BIAS_MAX_ENTRIES
from thinkbatch.limits import SAMPLING_LIMITS
from thinkbatch.limits import STOP_MAX_CHARS
from thinkbatch.limits import STOP_MAX_STRINGS
from thinkbatch.limits import STOP_TOKEN_IDS_MAX

_INPUT = ConfigDict(extra="forbid", strict=True)


def _non_empty_stop(value: str) -> str:
    if not value:
        raise ValueError("must be a non-empty string (the engine refuses an empty stop string)")
    return value


StopString = Annotated[str, Field(max_length=STOP_MAX_CHARS), AfterValidator(_non_empty_stop)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Bias = Annotated[float, Field(ge=-LOGIT_BIAS_MAX, le=LOGIT_BIAS_MAX, allow_inf_nan=False)]


class SamplingParamsIn(BaseModel):
    """Sampling parameters of a job, or one item's overrides of them. All optional.

    Bounds come from the one table in thinkbatch/limits.py, checked against the engine's own."""

    model_config = _INPUT

    max_tokens: int | None = SAMPLING_LIMITS["max_tokens"].field()
    temperature: float | None = SAMPLING_LIMITS["temperature"].field()
    top_p: float | None = SAMPLING_LIMITS["top_p"].field()
    top_k: int | None = SAMPLING_LIMITS["top_k"].field()
    seed: int | None = SAMPLING_LIMITS["seed"].field()
    stop: StopString | Annotated[list[StopString], Field(max_length=STOP_MAX_STRINGS)] | None = (
        Field(None, description="A stop string or a list of them; generation ends before one.")
    )
    presence_penalty: float | None = SAMPLING_LIMITS["presence_penalty"].field()
    frequency_penalty: float | None = SAMPLING_LIMITS["frequency_penalty"].field()
    repetition_penalty: float | None = SAMPLING_LIMITS["repetition_penalty"].field()
    thinking_budget: int | None = SAMPLING_LIMITS["thinking_budget"].field()
    enable_thinking: bool | None = Field(
        None, description="Default true; false: the chat template closes an empty thinking block."
    )
    ignore_eos: bool | None = Field(None, description="Generate to max_tokens, past the end.")
    reasoning_effort: ReasoningEffort | None = Field(
        None,
        description="`none` turns thinking off; `minimal` to `high` set a thinking budget from "
        "REASONING_EFFORT_BUDGETS. Not with enable_thinking or thinking_budget beside it.",
    )
    n: int | None = SAMPLING_LIMITS["n"].field()
    min_p: float | None = SAMPLING_LIMITS["min_p"].field()
    # A token id in its one decimal spelling: "01" beside "1" would be one id given twice, the
    # engine keeping either bias.
    logit_bias: dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,9})$")], Bias] | None = Field(
        None,
        max_length=LOGIT_BIAS_MAX_ENTRIES,
        description="Token id (a decimal string without leading zeros) to a bias in "
        "[-100, 100] added to its logit.",
    )
    stop_token_ids: Annotated[list[TokenId], Field(max_length=STOP_TOKEN_IDS_MAX)] | None = Field(
        None, description="Token ids that end the generation, as a stop string does."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="Keep the stop string that ended the answer at its end."
    )
    logprobs: bool | None = Field(
        None, description="Return the log probability of each answer token (OpenAI's shape)."
    )
    top_logprobs: int | None = SAMPLING_LIMITS["top_logprobs"].field()
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: text, json_object or json_schema, for the answer only."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: json, regex, choice or grammar, for the answer only."
    )
    tools: Tools | None = Field(
        None, description="Functions the model may call, rendered by the chat template."
    )
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function."
    )
    parallel_tool_calls: bool | None = Field(
        None,
        description="false: at most one tool call per choice (with required, the grammar allows "
        "one; with auto, the first call is kept, as vLLM keeps it). Needs tools.",
    )

    @field_validator(*(n for n, limit in SAMPLING_LIMITS.items() if limit.min_nonzero))
    @classmethod
    def _no_silent_clamp(cls, value: float | None, info: ValidationInfo) -> float | None:
        # The engine would raise such a value to its minimum with only a log line: refuse it.
        floor = SAMPLING_LIMITS[str(info.field_name)].min_nonzero
        if value is not None and floor is not None and 0 < value < floor:
            raise ValueError(f"must be 0 or at least {floor}, got {value}")
        return value

    def overrides(self) -> dict[str, object]:
        return self.model_dump(exclude_none=True, by_alias=True)


class ToolCallFunction(BaseModel):
    model_config = _INPUT
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(description="The call's arguments as a JSON string, as OpenAI's.")


class ToolCall(BaseModel):
    model_config = _INPUT
    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"]
    function: ToolCallFunction


class Message(BaseModel):
    """One turn. An assistant turn may carry earlier `tool_calls` (its content may then be
    null), and a `tool` turn the result of one (`tool_call_id`)."""

    model_config = _INPUT

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = Field(None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _shape_of_its_role(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content: Field required (null only beside an assistant's tool_calls)")
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("tool_calls: only an assistant message carries tool calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("tool_call_id: a tool message names the call it answers, and only it")
        return self


class ItemIn(BaseModel):
    """One item: a conversation (`messages`, chat template applied) or a raw `prompt`."""

    model_config = _INPUT

    custom_id: str | None = Field(None, min_length=1, max_length=128)
    model: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The served name (a base model or a LoRA adapter) this item runs on; "
        "unset: the job's.",
    )
    messages: list[Message] | None = Field(None, min_length=1)
    prompt: str | None = Field(None, min_length=1)
    params: SamplingParamsIn | None = None

    @model_validator(mode="after")
    def one_input(self) -> ItemIn:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of 'messages' or 'prompt'")
        return self


class JobHeader(BaseModel):
    """Everything of a job request but its items."""

    model_config = _INPUT

    model: str | None = Field(None, min_length=1, max_length=256)
    params: SamplingParamsIn = Field(default_factory=SamplingParamsIn)
    metadata: (
        dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None
    ) = Field(None, max_length=16, description="Kept as sent: none, `{}` or up to 16 pairs.")
    priority: int = Field(0, ge=0, le=9, description="Higher gets a larger share of a worker.")
    completion_window: int | None = Field(
        None, gt=0, description="Seconds until unfinished items expire."
    )


class JobCreate(JobHeader):
    """POST /v1/jobs."""

    items: list[ItemIn] = Field(min_length=1)


class Counts(BaseModel):
    total: int
    pending: int
    running: int
    succeeded: int
    failed: int
    cancelled: int
    expired: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int


class ThinkingLength(BaseModel):
    """Reasoning tokens per item, over the succeeded items that thought (reasoning_tokens > 0)."""

    items: int = Field(description="Succeeded items that thought.")
    p50: int | None = Field(description="Median reasoning tokens (a value some item had).")
    p90: int | None
    max: int | None


class Truncations(BaseModel):
    by_budget: int = Field(
        description="Items whose thinking the engine closed at thinking_budget; they answered."
    )
    by_max_tokens: int = Field(
        description="Items cut by max_tokens (or the context) inside their thinking: no answer."
    )


class JobStats(BaseModel):
    """What the thinking cost, over the job's succeeded items, computed when read."""

    reasoning_share: float | None = Field(
        description="usage.reasoning_tokens / usage.completion_tokens; null before any output."
    )
    thinking_tokens: ThinkingLength
    thinking_truncated: Truncations


class ErrorInfo(BaseModel):
    code: str
    message: str


class JobOut(BaseModel):
    id: uuid.UUID
    status: str
    model: str
    priority: int
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    expires_at: datetime
    counts: Counts
    usage: Usage
    metadata: dict[str, str]
    error: ErrorInfo | None
    stats: JobStats | None = Field(
        None,
        description="Thinking statistics over the succeeded items, computed when read (a "
        "running job's may be up to 5 s old). Null in the list of jobs.",
    )
    waiting_for: list[str] = Field(
        default_factory=list,
        description="The models of its pending items that no live worker serves: it waits for "
        "a worker of each (configured in SERVED_MODELS) to start.",
    )


class TopLogprob(BaseModel):
    token: str
    logprob: float = Field(description="Natural log; -9999.0 stands for minus infinity.")
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceOut(BaseModel):
    """One of an item's choices (`n` > 1), each generated on its own."""

    index: int
    thinking: str | None
    answer: str | None
    answer_json: Any = Field(None, description="The answer parsed, for a JSON answer.")
    tool_calls: list[ToolCall] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None
    thinking_truncated: bool | None
    completion_tokens: int
    reasoning_tokens: int


class ItemOut(BaseModel):
    """An item's record. Its answer fields are its first choice; `choices` lists them all
    when it asked for more than one, and `usage` sums over them."""

    custom_id: str
    model: str | None = Field(None, description="The served name it runs on.")
    status: str
    thinking: str | None
    answer: str | None
    answer_json: Any = Field(
        None,
        description="The answer parsed, when a response_format or structured_outputs asked "
        "for JSON (the answer was checked against its schema before it was stored).",
    )
    tool_calls: list[ToolCall] | None = Field(
        None, description="The calls the answer makes, with tools; finish_reason is tool_calls."
    )
    logprobs: list[TokenLogprob] | None = Field(
        None, description="The answer tokens' log probabilities, with logprobs: true."
    )
    finish_reason: str | None
    thinking_truncated: bool | None
    usage: Usage | None
    choices: list[ChoiceOut] | None = Field(None, description="Every choice, when n > 1.")
    attempts: int
    error: ErrorInfo | None
    started_at: datetime | None
    finished_at: datetime | None


class ItemPage(BaseModel):
    data: list[ItemOut]
    has_more: bool
    last_id: str | None


class JobPage(BaseModel):
    data: list[JobOut]
    has_more: bool
    last_id: uuid.UUID | None
