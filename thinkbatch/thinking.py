"""Split a Qwen3-style completion into its thinking and its answer, and count thinking tokens.

Qwen3 writes `<think>…</think>` and then the answer. The cases this module handles:

* thinking on (Qwen3 hybrid): the output starts with `<think>`, closes it, then answers;
* thinking off: the chat template already put an empty `<think>\\n\\n</think>\\n\\n` in the
  prompt, so the output is only the answer;
* thinking-only templates (Qwen3-*-Thinking-2507) open `<think>` inside the prompt, so the
  output holds only the closing `</think>`;
* cut inside the thinking (max_tokens reached before `</think>`): all of it is thinking, the
  answer is empty and the split says `thinking_truncated`;
* closed by the thinking budget: the engine forced `</think>` after `thinking_budget` tokens
  and the model answered; `thinking_truncated(...)` says so from the token count.

The engine adapters, the runner and the tests use this module's functions (split, where the
answer starts, count, truncated, and whether a prompt opens the block); nothing else parses
thinking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(slots=True)  # not frozen: one per item (see ledger.Claimed)
class ThinkingSplit:
    thinking: str
    answer: str
    truncated: bool
    # Characters between `</think>` and the answer that are neither: the line breaks the model
    # writes after the block. The answer's logprobs skip the tokens that spell them.
    separator: str = ""


# What Qwen3 writes between `</think>` and the answer (its template's `</think>\n\n`). Only
# line breaks: a space or an indent there is the answer's own (a completion's leading space,
# the first line of indented code), and is kept.
SEPARATOR = "\r\n"


def split_thinking(text: str, *, opened_in_prompt: bool = False) -> ThinkingSplit:
    """Split generated `text`. `opened_in_prompt`: the prompt ended inside an open `<think>`.

    The answer is the text as generated, save the line breaks that separate it from a closed
    thinking block: its leading space, indentation, trailing text and any stop string kept by
    `include_stop_str_in_output` stay, so that it matches its logprobs token by token. The
    thinking is trimmed: it is prose for people, and no logprobs cover it.
    """
    end = text.find(THINK_END)
    if end >= 0:
        thinking = text[:end]
        rest = text[end + len(THINK_END) :]
        answer = rest.lstrip(SEPARATOR)
        stripped = thinking.lstrip()
        if stripped.startswith(THINK_START):
            thinking = stripped[len(THINK_START) :]
        return ThinkingSplit(
            thinking.strip(), answer, truncated=False, separator=rest[: len(rest) - len(answer)]
        )
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):
        return ThinkingSplit(stripped[len(THINK_START) :].strip(), "", truncated=True)
    if opened_in_prompt:
        return ThinkingSplit(text.strip(), "", truncated=True)
    return ThinkingSplit("", text, truncated=False)


def answer_start(text: str, *, opened_in_prompt: bool = False) -> int | None:
    """Where the answer that `split_thinking` finds in `text` begins, or None while `text`
    (a generation so far) has not reached it: inside the thinking, in the line breaks after
    `</think>`, or not yet past a start that may be `<think>`."""
    end = text.find(THINK_END)
    if end >= 0:
        rest = end + len(THINK_END)
        answer = len(text) - len(text[rest:].lstrip(SEPARATOR))
        return answer if answer < len(text) else None
    stripped = text.lstrip()
    if stripped.startswith(THINK_START) or opened_in_prompt:
        return None
    if THINK_START.startswith(stripped):  # "" or part of the tag: not yet known
        return None
    return 0


def count_reasoning_tokens(
    output_ids: Sequence[int],
    *,
    start_id: int | None,
    end_id: int | None,
    opened_in_prompt: bool = False,
) -> int:
    """Output tokens that belong to the thinking block, tags included, from the engine's ids."""
    if end_id is not None:
        try:
            return output_ids.index(end_id) + 1
        except ValueError:
            pass
    if opened_in_prompt or (start_id is not None and output_ids and output_ids[0] == start_id):
        return len(output_ids)  # cut inside the thinking: every token is thinking
    return 0


def closed_by_budget(*, reasoning_tokens: int, budget: int | None) -> bool:
    """Whether the thinking budget forced `</think>`: the block holds `budget` tokens (the
    opening `<think>` included, as usage counts it) and then the forced `</think>`.

    A model that closes on its own at exactly that token is indistinguishable, and is counted
    as closed by the budget: the engine would have forced the same token there.
    """
    return budget is not None and reasoning_tokens >= budget + 1


def thinking_truncated(split: ThinkingSplit, *, reasoning_tokens: int, budget: int | None) -> bool:
    """The item's `thinking_truncated`: cut by max_tokens (no `</think>` at all; the answer is
    empty) or closed by the thinking budget (the answer follows). Statistics tell the two apart
    by whether every completion token was thinking (see thinkbatch/jobs/stats.py)."""
    return split.truncated or closed_by_budget(reasoning_tokens=reasoning_tokens, budget=budget)


def _last_think_tag(
    prompt_ids: Sequence[int], start_id: int | None, end_id: int | None, turn_start_id: int | None
) -> int | None:
    """The last `<think>` or `</think>` id of the prompt's last chat turn, or None. Scans back
    from the end, stopping at the start of that turn, so that a tag in an earlier message does
    not count."""
    for token in reversed(prompt_ids):
        if token == start_id or token == end_id:
            return token
        if token == turn_start_id:
            return None
    return None


def prompt_opens_thinking(
    prompt_ids: Sequence[int],
    *,
    start_id: int | None,
    end_id: int | None,
    turn_start_id: int | None = None,
) -> bool:
    """Whether the prompt leaves a `<think>` open for the model (thinking-only templates)."""
    if start_id is None:
        return False
    return _last_think_tag(prompt_ids, start_id, end_id, turn_start_id) == start_id


def prompt_closes_thinking(
    prompt_ids: Sequence[int],
    *,
    start_id: int | None,
    end_id: int | None,
    turn_start_id: int | None = None,
) -> bool:
    """Whether the prompt's last chat turn already holds a closed thinking block (a template
    that turns thinking off writes an empty one): the model's output is then the answer."""
    if end_id is None:
        return False
    return _last_think_tag(prompt_ids, start_id, end_id, turn_start_id) == end_id
