"""The one shape an item's outcome is read in: `ResultRow`, by one query. The native item
records (`ItemOut`, pages and the JSONL results) and the OpenAI output and error lines are all
made from it.

Only what an outcome shows is read: not the prompt or messages, whose JSON would be parsed for
every row of a 100k-item download for nothing; and without thinking, not even that column (a
client downloading 100,000 answers need not pay for the reasoning).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from thinkbatch.jobs.wire import ErrorInfo
from thinkbatch.jobs.wire import ItemOut
from thinkbatch.jobs.wire import Usage
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import ItemStatus


@dataclass(frozen=True, slots=True)
class ResultRow:
    item_id: int
    seq: int
    custom_id: str
    status: str
    attempts: int
    error_code: str | None
    error_message: str | None
    started_at: datetime | None
    finished_at: datetime | None
    # The result's columns: None for an item with no stored result.
    thinking: str | None
    answer: str | None
    finish_reason: str | None
    thinking_truncated: bool | None
    prompt_tokens: int | None
    completion_tokens: int | None
    reasoning_tokens: int | None

    def item_out(self) -> ItemOut:
        """The native record of the item."""
        return ItemOut(
            custom_id=self.custom_id,
            status=self.status,
            thinking=self.thinking,
            answer=self.answer,
            finish_reason=self.finish_reason,
            thinking_truncated=self.thinking_truncated,
            usage=(
                Usage(
                    prompt_tokens=self.prompt_tokens or 0,
                    completion_tokens=self.completion_tokens or 0,
                    reasoning_tokens=self.reasoning_tokens or 0,
                )
                if self.finish_reason is not None
                else None
            ),
            attempts=self.attempts,
            error=(
                ErrorInfo(code=self.error_code, message=self.error_message or "")
                if self.error_code and self.status != ItemStatus.succeeded
                else None
            ),
            started_at=self.started_at,
            finished_at=self.finished_at,
        )


_COLUMNS: tuple[Any, ...] = (
    Item.id,
    Item.seq,
    Item.custom_id,
    Item.status,
    Item.attempts,
    Item.error_code,
    Item.error_message,
    Item.started_at,
    Item.finished_at,
    ItemResult.thinking,
    ItemResult.answer,
    ItemResult.finish_reason,
    ItemResult.thinking_truncated,
    ItemResult.prompt_tokens,
    ItemResult.completion_tokens,
    ItemResult.reasoning_tokens,
)
_NO_THINKING = tuple(
    sa.null().label("thinking") if column is ItemResult.thinking else column for column in _COLUMNS
)


def query(
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None = None,
    succeeded: bool | None = None,
    include_thinking: bool = True,
) -> sa.Select[Any]:
    """The job's rows in submission order: of one status, or (`succeeded`) only the succeeded
    ones or only the others."""
    select = (
        sa.select(*(_COLUMNS if include_thinking else _NO_THINKING))
        .outerjoin(ItemResult, ItemResult.item_id == Item.id)
        .where(Item.job_id == job_id)
        .order_by(Item.seq)
    )
    if status is not None:
        select = select.where(Item.status == status)
    if succeeded is not None:
        select = select.where(
            Item.status == ItemStatus.succeeded
            if succeeded
            else Item.status != ItemStatus.succeeded
        )
    return select


def row(values: sa.Row[Any]) -> ResultRow:
    fields: list[Any] = list(values)
    status = fields[3]
    fields[3] = status.value if isinstance(status, ItemStatus) else str(status)
    return ResultRow(*fields)


def stream(engine: sa.Engine, select: sa.Select[Any], batch: int = 1000) -> Iterator[ResultRow]:
    """The rows through a server-side cursor: memory stays flat however large the job, and one
    download sees one snapshot."""
    with engine.connect() as conn:
        for values in conn.execute(select.execution_options(yield_per=batch)):
            yield row(values)


def of_job(
    engine: sa.Engine,
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None = None,
    succeeded: bool | None = None,
    include_thinking: bool = True,
) -> Iterator[ResultRow]:
    """The job's rows, streamed (query and stream above). Unscoped: the caller checked the
    job's ownership, or is the system itself (a worker making a batch's files)."""
    select = query(job_id, status=status, succeeded=succeeded, include_thinking=include_thinking)
    return stream(engine, select)
