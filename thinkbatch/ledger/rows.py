"""The rows the ledger hands out and takes in: claimed items, results and failures to store,
and what a caller or a locking transaction learns of a job."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any


# Not frozen: built once per item on the hot path, where a frozen dataclass's __init__
# (object.__setattr__ per field) cost ~10x a plain one (bench/throughput.py, ceiling).
@dataclass(slots=True)
class Claimed:
    id: int
    job_id: uuid.UUID
    seq: int
    custom_id: str
    messages: list[dict[str, Any]] | None
    prompt: str | None
    params: dict[str, Any] | None
    attempt: int
    crashes: int
    # The served name it runs on; None in the ledger for the job's own model, which the runner
    # fills in once claimed (every item it hands the engine names its model).
    model: str | None = None


@dataclass(slots=True)  # not frozen: see Claimed
class Done:
    """A finished generation, ready to store."""

    item_id: int
    job_id: uuid.UUID
    attempt: int
    thinking: str
    answer: str
    finish_reason: str
    thinking_truncated: bool
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    # Every choice, when the item asked for more than the plain one (several, logprobs, tools,
    # a JSON answer); the fields above then hold the first, and token counts summed over all.
    choices: list[dict[str, Any]] | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    item_id: int
    job_id: uuid.UUID
    attempt: int
    code: str
    message: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class JobState:
    id: uuid.UUID
    status: str
    expired: bool
    pending: int
    running: int
    total: int
    done: int


@dataclass(frozen=True, slots=True)
class Locked:
    """What a transaction that locked a job needs to know of it."""

    id: uuid.UUID
    status: str
    expired: bool
