"""Stop strings end the answer, never the thinking.

A request's `stop` strings are written for the answer: `"\\n\\n"`, `"Answer:"` or a closing tag
also turn up while a reasoning model thinks (it restates the question, plans the format), and
an engine that matches them there ends the generation inside the thinking, with an empty
answer and `finish_reason: "stop"`. vLLM matches stop strings over the whole output, so the
adapter gives it none for an item that may think, and this module finds them in the answer as
the text arrives; the adapter then ends the request there.

The cut is the one vLLM makes (its detokenizer's check_stop_strings), in the answer: the stop
string that ends first, the text ending before it (or after it, with
include_stop_str_in_output), and the tokens kept up to the one that completes it. Sampling is
causal, so those are the tokens a generation stopped there would have had.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from thinkbatch.thinking import SEPARATOR
from thinkbatch.thinking import THINK_END
from thinkbatch.thinking import THINK_START
from worker.engine import Prepared


@dataclass(frozen=True, slots=True)
class Cut:
    text_end: int  # the text is text[:text_end]
    stop_end: int  # where the stop string ends: the token that reaches it is the last kept
    stop: str


class AnswerStops:
    """The stop strings of one choice, checked against its text as it grows. Each call costs
    what the text gained, not its length: the answer's start and the stop strings are looked
    for only where they may newly be."""

    def __init__(self, stops: Sequence[str], *, opened_in_prompt: bool, keep: bool):
        self.stops = tuple(stops)
        self.keep = keep
        self._longest = max(map(len, self.stops), default=0)
        self._checked = 0  # text scanned so far: a stop string may end past it, not before
        # Whether the text opens with thinking (None until its first characters tell), and
        # where the answer starts once that is known.
        self._thinking: bool | None = True if opened_in_prompt else None
        self._start: int | None = None
        self._end_from = 0  # where the search for </think> resumes

    def answer_from(self, text: str) -> int | None:
        """Where the answer starts in `text`, as thinkbatch.thinking.answer_start finds it, or
        None while it has not: after the first `</think>` and its line breaks; before one, at
        0 if the text opened without thinking, else not yet. (A text that opened without
        thinking and writes `</think>` later has had its first part checked as answer.)"""
        if self._start is not None:
            return self._start
        if self._thinking is None:
            stripped = text.lstrip()  # short: only until the first characters are in
            if not (THINK_START.startswith(stripped) and THINK_END not in text):
                self._thinking = stripped.startswith(THINK_START)
        at = text.find(THINK_END, self._end_from)
        if at < 0:
            self._end_from = max(self._end_from, len(text) - len(THINK_END) + 1)
            return 0 if self._thinking is False else None
        start = at + len(THINK_END)
        while start < len(text) and text[start] in SEPARATOR:
            start += 1
        if start == len(text):  # only the line breaks after </think> so far
            self._end_from = at
            return None
        self._start = start
        return start

    def feed(self, text: str) -> Cut | None:
        """The cut, once `text` (the choice's whole text so far) holds a stop string in its
        answer; None until then. Of several, the one that ends first, and of those ending
        together the first listed: vLLM's choice (check_stop_strings)."""
        start = self.answer_from(text)
        if start is None:
            return None
        since = max(start, self._checked - self._longest + 1)
        self._checked = len(text)
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, since)
            if at >= 0 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        if best is None:
            return None
        end, at, stop = best
        return Cut(text_end=end if self.keep else at, stop_end=end, stop=stop)


def tokens_kept(offsets: Sequence[int], stop_end: int) -> int:
    """How many tokens (or chunks of them) to keep, given the text's length after each one:
    those up to the first that reaches `stop_end`."""
    for kept, offset in enumerate(offsets, start=1):
        if offset >= stop_end:
            return kept
    return len(offsets)


@dataclass(slots=True)
class StreamedChoice:
    """One choice put together from its deltas, in the shape of the engine's own completion
    output (index, text, token_ids, logprobs, finish_reason, stop_reason)."""

    index: int
    stops: AnswerStops
    decode: Callable[[list[int]], str]  # token ids to text, as the engine's detokenizer
    text: str = ""
    offsets: list[int] = field(default_factory=list)  # the text's length after each delta
    chunks: list[list[int]] = field(default_factory=list)  # each delta's token ids
    logprob_chunks: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    @property
    def token_ids(self) -> list[int]:
        return [token for chunk in self.chunks for token in chunk]

    @property
    def logprobs(self) -> list[Any] | None:
        if not self.logprob_chunks:
            return None
        return [entry for chunk in self.logprob_chunks for entry in chunk]

    def take(self, delta: Any) -> None:
        self.text += delta.text
        self.offsets.append(len(self.text))
        self.chunks.append(list(delta.token_ids))
        if delta.logprobs is not None:
            self.logprob_chunks.append(delta.logprobs)
        cut = self.stops.feed(self.text)
        if cut is not None:
            kept = tokens_kept(self.offsets, cut.stop_end)
            del self.chunks[kept:], self.logprob_chunks[kept:], self.offsets[kept:]
            self._trim_last(cut.stop_end)
            self.text = self.text[: cut.text_end]
            self.finish_reason, self.stop_reason = "stop", cut.stop
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason

    def _trim_last(self, stop_end: int) -> None:
        """Keep the last delta's tokens only up to the one that reaches `stop_end`, as vLLM
        keeps them. A delta holds several tokens when vLLM merges the outputs its consumer has
        not taken yet (a busy event loop), or a step's accepted draft tokens."""
        last = self.chunks[-1]
        if len(last) < 2:
            return
        # Each token's end in the text, measured from the delta's start as the detokenizer
        # writes it: the text before it decoded alongside (a tokenizer may write a leading
        # space only after other text), and a character the tokens end inside not yet counted
        # (the detokenizer holds it back until it is whole).
        before = [token for chunk in self.chunks[:-1] for token in chunk]
        offset = self.offsets[-2] if len(self.offsets) > 1 else 0
        base = len(self.decode(before).rstrip("\ufffd"))

        def end_of(j: int) -> int:
            return offset + len(self.decode(before + last[:j]).rstrip("\ufffd")) - base

        kept = next((j for j in range(1, len(last)) if end_of(j) >= stop_end), len(last))
        del last[kept:]
        if self.logprob_chunks:
            self.logprob_chunks[-1] = list(self.logprob_chunks[-1])[:kept]


class StoppingChoices:
    """The choices of one request, streamed as deltas, each cut at the first stop string of
    its answer."""

    def __init__(self, prepared: Prepared, decode: Callable[[list[int]], str]):
        self.n = prepared.sampling.n
        self.prepared = prepared
        self.decode = decode
        self._choices: dict[int, StreamedChoice] = {}

    def add(self, deltas: Sequence[Any]) -> bool:
        """One step's deltas; True once every choice has ended, by the engine or by a stop
        string in its answer (the request may then be aborted)."""
        for delta in deltas:
            choice = self._choices.get(delta.index)
            if choice is None:
                stops = AnswerStops(
                    self.prepared.answer_stops,
                    opened_in_prompt=self.prepared.opened_in_prompt,
                    keep=self.prepared.sampling.include_stop_str_in_output,
                )
                choice = StreamedChoice(delta.index, stops, self.decode)
                self._choices[delta.index] = choice
            if choice.finish_reason is None:
                choice.take(delta)
        done = (c.finish_reason is not None for c in self._choices.values())
        return len(self._choices) == self.n and all(done)

    def completions(self) -> list[StreamedChoice]:
        return [self._choices[i] for i in sorted(self._choices)]
