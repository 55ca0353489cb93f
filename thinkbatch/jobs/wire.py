"""Wire formats of the REST API, as pydantic models.

Inputs forbid unknown fields and coerce nothing (`strict`), so a typo or a number sent as a
string is a 400 that names the field instead of a silently ignored setting.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated
from typing import Literal

from pydantic import AfterValidator
from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field
from pydantic import ValidationInfo
from pydantic import field_validator
from pydantic import model_validator

from thinkbatch.limits import SAMPLING_LIMITS
from thinkbatch.limits import STOP_MAX_CHARS
from thinkbatch.limits import STOP_MAX_STRINGS

_INPUT = ConfigDict(extra="forbid", strict=True)


def _non_empty_stop(value: str) -> str:
    if not value:
        raise ValueError("must be a non-empty string (the engine refuses an empty stop string)")
    return value


StopString = Annotated[str, Field(max_length=STOP_MAX_CHARS), AfterValidator(_non_empty_stop)]


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
    enable_thinking: bool | None = None
    ignore_eos: bool | None = None

    @field_validator(*(n for n, limit in SAMPLING_LIMITS.items() if limit.min_nonzero))
    @classmethod
    def _no_silent_clamp(cls, value: float | None, info: ValidationInfo) -> float | None:
        # The engine would raise such a value to its minimum with only a log line: refuse it.
        floor = SAMPLING_LIMITS[str(info.field_name)].min_nonzero
        if value is not None and floor is not None and 0 < value < floor:
            raise ValueError(f"must be 0 or at least {floor}, got {value}")
        return value

    def overrides(self) -> dict[str, object]:
        return self.model_dump(exclude_none=True)


class Message(BaseModel):
    model_config = _INPUT

    role: Literal["system", "user", "assistant"]
    content: str


class ItemIn(BaseModel):
    """One item: a conversation (`messages`, chat template applied) or a raw `prompt`."""

    model_config = _INPUT

    custom_id: str | None = Field(None, min_length=1, max_length=128)
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


class ItemOut(BaseModel):
    custom_id: str
    status: str
    thinking: str | None
    answer: str | None
    finish_reason: str | None
    thinking_truncated: bool | None
    usage: Usage | None
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
