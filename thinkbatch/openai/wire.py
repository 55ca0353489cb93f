"""Wire models of the OpenAI-compatible routes, as the API answers them (and documents them in
/openapi.json). Their shapes are OpenAI's (`openai.types.FileObject`, `Batch`, ...); the
acceptance tests validate answers with the official SDK's own types."""

from __future__ import annotations

from typing import Annotated
from typing import Literal

from pydantic import BaseModel
from pydantic import ConfigDict
from pydantic import Field

EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 2592000  # OpenAI's bounds of expires_after.seconds
_INPUT = ConfigDict(extra="forbid", strict=True)
Metadata = dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]]


class ExpiresAfter(BaseModel):
    model_config = _INPUT
    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_MIN_S, le=EXPIRES_MAX_S)


class BatchCreate(BaseModel):
    """POST /v1/batches."""

    model_config = _INPUT
    input_file_id: str = Field(max_length=64)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: str = Field(
        max_length=16, description='`"<N>h"`, e.g. `"24h"`; capped by MAX_COMPLETION_WINDOW_S.'
    )
    metadata: Metadata | None = Field(None, max_length=16)
    output_expires_after: ExpiresAfter | None = None


class FileUpload(BaseModel):
    """POST /v1/files (multipart/form-data)."""

    file: bytes = Field(description="The JSONL file (at most MAX_FILE_BYTES).")
    purpose: Literal["batch"]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    expires_at: int | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str
    line: int | None
    message: str
    param: str | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class BatchUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    model: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing", "completed", "expired",
        "cancelling", "cancelled",
    ]  # fmt: skip
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class Model(BaseModel):
    id: str
    object: Literal["model"]
    created: int | None = Field(description="When its first live worker started; null: none.")
    owned_by: str
    parent: str | None = Field(
        None, description="For a LoRA adapter: the base model it runs on (as vLLM names it)."
    )
    workers: int = Field(0, description="Live workers that serve it now; 0: jobs wait for one.")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]
