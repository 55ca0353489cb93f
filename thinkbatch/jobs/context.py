"""Items that cannot fit the model's context are refused at submit, before any tokenizer runs.

A worker counts an item's tokens only when it claims it; an item far longer than the context
would cost it the tokenizing of megabytes, then fail. The API has no tokenizer, but it can bound
the count from below with what each live worker of the model recorded (thinkbatch.models.Worker,
measured by its engine at start):

    tokens >= sum(ceil(content bytes / token_bytes_max) - 2) + messages * message_tokens_min

A token stands for at most `token_bytes_max` bytes of text, the chat template adds at least
`message_tokens_min` tokens per message, and a content shares at most its first and last token
with the template's text around it. Only text the prompt is sure to carry whole counts: a
raw prompt, and the contents of system, user and tool messages (a template may drop parts of
earlier assistant turns, as Qwen3's does with their thinking). When that floor reaches the
largest context of the live workers, no worker could run the item: it is refused as
`prompt_too_long`, the code the worker would have given it. With no live worker of the model
there is nothing to check against, and the worker's own count decides, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa

from thinkbatch.jobs.wire import ItemIn
from thinkbatch.models import Worker

_VERBATIM_ROLES = ("system", "user", "tool")


@dataclass(frozen=True, slots=True)
class ContextBound:
    max_model_len: int
    token_bytes_max: int
    message_tokens_min: int

    def floor(self, item: ItemIn) -> int:
        """At least this many prompt tokens, whatever the tokenizer."""
        if item.prompt is not None:
            return -(-len(item.prompt.encode("utf-8")) // self.token_bytes_max)
        messages = item.messages or ()
        # A content's first and last bytes may merge into one token with the template's text
        # beside them (a content "\n" after the template's "\n"): each content is sure of its
        # own tokens but those two.
        content = sum(
            max(0, -(-len((m.content or "").encode("utf-8")) // self.token_bytes_max) - 2)
            for m in messages
            if m.role in _VERBATIM_ROLES
        )
        return content + len(messages) * self.message_tokens_min

    def refusal(self, item: ItemIn) -> str | None:
        """Why the item cannot fit, or None when it may."""
        tokens = self.floor(item)
        if tokens < self.max_model_len:
            return None
        return (
            f"at least {tokens} prompt tokens, and the model's context is {self.max_model_len} "
            "tokens"
        )


def for_model(conn: sa.Connection, model: str, *, dead_after_s: float) -> ContextBound | None:
    """The bound the live workers of `model` allow: the largest context among them, with the
    tokenizer figures that make the floor lowest. None when no live worker recorded them."""
    # The database's clock, as every judgement of a heartbeat (thinkbatch/ledger/workers.py).
    since = sa.func.now() - sa.func.make_interval(0, 0, 0, 0, 0, 0, dead_after_s)
    row = conn.execute(
        sa.select(
            sa.func.max(Worker.max_model_len),
            sa.func.max(Worker.token_bytes_max),
            sa.func.min(Worker.message_tokens_min),
        ).where(
            # An adapter runs in its base model's context.
            sa.or_(Worker.model == model, Worker.adapters.contains([model])),
            Worker.stopped_at.is_(None),
            Worker.heartbeat_at > since,
            Worker.max_model_len.is_not(None),
            Worker.token_bytes_max.is_not(None),
            Worker.message_tokens_min.is_not(None),
        )
    ).one()
    longest, widest, fewest = row
    if longest is None or widest is None or fewest is None:
        return None
    return ContextBound(max_model_len=longest, token_bytes_max=widest, message_tokens_min=fewest)
