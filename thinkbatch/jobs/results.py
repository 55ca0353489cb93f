"""The one shape an item's outcome is read in: `ResultRow`, by one query. The native item
records (`ItemOut`, pages and the JSONL results) and the OpenAI output and error lines are all
made from it.

Only what an outcome shows is read: not the prompt or messages, whose JSON would be parsed for
every row of a 100k-item download for nothing; and without thinking, not even that column (a
client downloading 100,000 answers need not pay for the reasoning).
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import sqlalchemy as sa

from thinkbatch.db import Prepared
from thinkbatch.jobs.wire import ChoiceOut
from thinkbatch.jobs.wire import ItemOut
from thinkbatch.models import Item
from thinkbatch.models import ItemResult
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job


# Not frozen: a frozen dataclass sets each of its 19 fields through object.__setattr__, 1.9 us
# a row against 0.3, a tenth of a results download's CPU. Nothing changes a row once made.
@dataclass(slots=True)
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
    # Every choice as the worker stored it (ledger Done.choices); None for a plain item.
    choices: list[dict[str, Any]] | None = None
    error_param: str | None = None
    model: str | None = None  # the served name it ran (or runs) on

    def all_choices(self) -> list[dict[str, Any]]:
        """The item's choices as records, its one plain choice made from the row's columns."""
        if self.choices is not None:
            return self.choices
        return [
            {
                "thinking": self.thinking,
                "answer": self.answer,
                "finish_reason": self.finish_reason,
                "thinking_truncated": self.thinking_truncated,
                "completion_tokens": self.completion_tokens or 0,
                "reasoning_tokens": self.reasoning_tokens or 0,
            }
        ]

    def item_out(self) -> ItemOut:
        """The native record of the item."""
        choices = [choice_out(i, c, self.thinking is not None)
                   for i, c in enumerate(self.all_choices())] if self.choices else None  # fmt: skip
        first = choices[0] if choices else None
        # Built by pydantic's validator, in Rust: for these values (columns of the right types
        # already, the choices models already) it takes 2.0 us a record here, where
        # model_construct, in Python, took 5.6 and half of a results download's CPU.
        return ItemOut.model_validate(
            {
                "custom_id": self.custom_id,
                "model": self.model,
                "status": self.status,
                "thinking": self.thinking,
                "answer": first.answer if first else self.answer,
                "answer_json": first.answer_json if first else None,
                "tool_calls": first.tool_calls if first else None,
                "logprobs": first.logprobs if first else None,
                "choices": choices if choices and len(choices) > 1 else None,
                "finish_reason": first.finish_reason if first else self.finish_reason,
                "thinking_truncated": self.thinking_truncated,
                "usage": (
                    {
                        "prompt_tokens": self.prompt_tokens or 0,
                        "completion_tokens": self.completion_tokens or 0,
                        "reasoning_tokens": self.reasoning_tokens or 0,
                    }
                    if self.finish_reason is not None
                    else None
                ),
                "attempts": self.attempts,
                "error": (
                    {"code": self.error_code, "message": self.error_message or ""}
                    if self.error_code and self.status != ItemStatus.succeeded
                    else None
                ),
                "started_at": self.started_at,
                "finished_at": self.finished_at,
            }
        )


def choice_out(index: int, record: dict[str, Any], with_thinking: bool = True) -> ChoiceOut:
    answer = record.get("answer")
    return ChoiceOut(
        index=index,
        thinking=record.get("thinking") if with_thinking else None,
        answer=answer,
        answer_json=json.loads(answer) if record.get("json") and answer else None,
        tool_calls=record.get("tool_calls"),
        logprobs=record.get("logprobs"),
        finish_reason=record.get("finish_reason"),
        thinking_truncated=record.get("thinking_truncated"),
        completion_tokens=record.get("completion_tokens") or 0,
        reasoning_tokens=record.get("reasoning_tokens") or 0,
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
    ItemResult.choices,
    Item.error_param,
    # The job's model stands in for an item that names none: its model (query() binds it).
    Item.model,
)
# Without thinking: not the column, nor each choice's (taken out by Postgres, so that a client
# downloading answers does not receive the reasoning either way).
_CHOICES_WITHOUT_THINKING: sa.Label[Any] = sa.literal_column(
    "(SELECT jsonb_agg(e.c - 'thinking' ORDER BY e.o) "
    "FROM jsonb_array_elements(item_results.choices) WITH ORDINALITY AS e(c, o))"
).label("choices")
_NO_THINKING = tuple(
    sa.null().label("thinking")
    if column is ItemResult.thinking
    else _CHOICES_WITHOUT_THINKING
    if column is ItemResult.choices
    else column
    for column in _COLUMNS
)


def query(
    job_id: uuid.UUID | sa.BindParameter[uuid.UUID],
    *,
    status: ItemStatus | None = None,
    succeeded: bool | None = None,
    include_thinking: bool = True,
) -> sa.Select[Any]:
    """The job's rows in submission order: of one status, or (`succeeded`) only the succeeded
    ones or only the others."""
    # An item that names no model runs on its job's: looked up once (an InitPlan), not joined.
    job_model = sa.select(Job.model).where(Job.id == job_id).scalar_subquery()
    columns = [
        sa.func.coalesce(Item.model, job_model).label("model") if column is Item.model else column
        for column in (_COLUMNS if include_thinking else _NO_THINKING)
    ]
    select = (
        sa.select(*columns)
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


@functools.cache
def page_statement(*, include_thinking: bool, by_status: bool, window: bool) -> Prepared:
    """A page of a job's rows as one prepared statement, built and compiled once per shape:
    the rows after place `start` (and with `window`, up to place `end`), of `status` when
    `by_status`, at most `limit`. A page read this way cost about half a millisecond of CPU
    less than one built for each request and read through SQLAlchemy's result
    (`python -m bench.poll_cpu`)."""
    select = query(sa.bindparam("job_id", type_=sa.Uuid), include_thinking=include_thinking)
    select = select.where(Item.seq > sa.bindparam("start", type_=sa.Integer))
    if by_status:
        select = select.where(Item.status == sa.bindparam("status", type_=sa.String))
    if window:
        select = select.where(Item.seq <= sa.bindparam("end", type_=sa.Integer))
    return Prepared(select.limit(sa.bindparam("limit", type_=sa.Integer)))


def row(values: sa.Row[Any] | tuple[Any, ...]) -> ResultRow:
    fields: list[Any] = list(values)
    status = fields[3]
    fields[3] = status.value if isinstance(status, ItemStatus) else str(status)
    return ResultRow(*fields)


@dataclass(frozen=True, slots=True)
class Download:
    """A download's statement in two parts, each compiled once: its first rows (`head_rows`
    of them) as a server-side prepared statement, and the rows after those, streamed. Most
    downloads are a small job's, read whole by the head: Postgres plans it once per pooled
    connection, where a statement streamed was planned on every call: a 100-item job's download
    costs it 0.76x the CPU it did (`python -m bench.download`). `select` must be ordered by a
    key unique in its rows (a job's items by `seq`): the rest is the same order past the head."""

    head: Prepared
    rest: Prepared

    @classmethod
    def of(cls, select: sa.Select[Any]) -> Download:
        rows = sa.bindparam("head_rows", type_=sa.Integer)
        return cls(Prepared(select.limit(rows)), Prepared(select.offset(rows)))


def stream(
    engine: sa.Engine,
    statement: sa.Select[Any] | Download,
    params: dict[str, object] | None = None,
    batch: int = 1000,
) -> Iterator[ResultRow]:
    """The rows of one statement, as Postgres makes them: memory stays flat however large the
    job, and one download sees one snapshot.

    The statement is SQLAlchemy's, compiled once (`download_statement` keeps each shape's
    compiled text; `params` are its values). Its first `batch` rows come from one prepared
    statement (`Download`); the rest, if any, in libpq's chunked mode (psycopg's
    `Cursor.stream`, libpq 17 or later: the binary wheel's), `batch` rows a chunk, as the
    plain tuples psycopg makes of them, in the same transaction, which is REPEATABLE READ so
    that both parts read the snapshot the first one took. A named cursor's FETCH took a round
    trip per chunk, during which neither side worked: 0.3 s of a 100k-item download here.
    Through SQLAlchemy's result, each row also became a Row with its columns' result
    processing. A download that stops early (the client went away) cancels the statement;
    psycopg then drains what was already sent, and the connection goes back to the pool
    clean."""
    download = statement if isinstance(statement, Download) else Download.of(statement)
    values = {**download.head.defaults, **(params or {}), "head_rows": batch}
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        with driver.cursor() as cursor:
            cursor.execute(_ONE_SNAPSHOT_UNBOUNDED)
            cursor.execute(download.head.sql, values, prepare=True)
            head = cursor.fetchall()
            for row_values in head:
                yield ResultRow(*row_values)
            if len(head) == batch:
                # Closed as the download stops: closing psycopg's stream cancels the statement,
                # which otherwise runs on until its last row is sent, as the connection's
                # close waits for it.
                rest = cursor.stream(download.rest.sql, values, size=_chunk(batch))
                with contextlib.closing(rest):
                    for row_values in rest:
                        yield ResultRow(*row_values)
        # Ended by a commit, which for these reads is what a rollback is, but a rollback drops
        # the connection's prepared statements (psycopg), those of the polls that take this
        # pooled connection next (tests/unit/test_plan_reuse.py).
        driver.commit()


# One round trip before the rows (no parameters: psycopg sends both statements as one simple
# query, the first of the transaction). The snapshot: the head and the rest are two
# statements. The bounds: the rest's rows are pushed as fast as the client takes them; one
# that pauses leaves this backend blocked on a full socket. The session's tcp_user_timeout (a
# dead peer's bound, thinkbatch/db.py) would end it after WORKER_DEAD_AFTER_S of that, and an
# operator's statement_timeout would cut a long download: both are about Postgres's work,
# which here is paced by the client. Off for this transaction only; a dead API host still
# ends it when the kernel gives up retransmitting.
_ONE_SNAPSHOT_UNBOUNDED = (
    "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY; "
    "SELECT set_config('tcp_user_timeout', '0', true), set_config('statement_timeout', '0', true)"
)


def _chunk(batch: int) -> int:
    """Rows a chunk: `batch`, or single rows on a libpq older than 17 (a psycopg built against
    the system's libpq, where the binary wheel is not used), which has no chunked mode."""
    return batch if psycopg.pq.version() >= 170000 else 1


@functools.cache
def download_statement(
    *, status: ItemStatus | None, succeeded: bool | None, include_thinking: bool
) -> Download:
    """A job's rows (`query`) of one shape, its job bound as `job_id`, compiled once per
    process. Compiling the statement for each download took about 1.5 ms of the API's CPU, 15%
    of all of it under `make bench-scale`'s load run, where a fifth of the calls download a
    small job's results."""
    return Download.of(
        query(
            sa.bindparam("job_id", type_=sa.Uuid),
            status=status,
            succeeded=succeeded,
            include_thinking=include_thinking,
        )
    )


def of_job(
    engine: sa.Engine,
    job_id: uuid.UUID,
    *,
    status: ItemStatus | None = None,
    succeeded: bool | None = None,
    include_thinking: bool = True,
    batch: int = 1000,
) -> Iterator[ResultRow]:
    """The job's rows, streamed (query and stream above), `batch` rows a chunk. Unscoped: the
    caller checked the job's ownership, or is the system itself (a worker making a batch's
    files)."""
    statement = download_statement(
        status=status, succeeded=succeeded, include_thinking=include_thinking
    )
    return stream(engine, statement, {"job_id": job_id}, batch=batch)
