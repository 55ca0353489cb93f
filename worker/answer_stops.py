"""Stop strings end the answer, never the thinking.

A request's `stop` strings are written for the answer: `"\\n\\n"`, `"Answer:"` or a closing tag
also turn up while a reasoning model thinks (it restates the question, plans the format), and
an engine that matches them there ends the generation inside the thinking, with an empty
answer and `finish_reason: "stop"`. vLLM matches stop strings over the whole output, so the
adapter gives it none for an item that may think, and this module finds them in the answer as
the text arrives; the adapter then ends the request there.

The cut is the one vLLM makes (its detokenizer's check_stop_strings): the earliest stop string
of the answer, the text ends before it (or after it, with include_stop_str_in_output), and the
tokens up to the one that completes it are kept. Sampling is causal, so the tokens kept are the
ones a generation stopped there would have had.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field
from typing import Any

from thinkbatch.thinking import answer_start
from worker.engine import Prepared


@dataclass(frozen=True, slots=True)
class Cut:
    text_end: int  # the text is text[:text_end]
    stop_end: int  # where the stop string ends: the token that reaches it is the last kept
    stop: str


class AnswerStops:
    """The stop strings of one choice, checked against its text as it grows."""

    def __init__(self, stops: Sequence[str], *, opened_in_prompt: bool, keep: bool):
        self.stops = tuple(stops)
        self.opened_in_prompt = opened_in_prompt
        self.keep = keep
        self._longest = max(map(len, self.stops), default=0)
        self._checked = 0  # text scanned so far: a stop string may end past it, not before

    def feed(self, text: str) -> Cut | None:
        """The cut, once `text` (the choice's whole text so far) holds a stop string in its
        answer; None until then."""
        start = answer_start(text, opened_in_prompt=self.opened_in_prompt)
        if start is None:
            return None
        since = max(start, self._checked - self._longest + 1)
        self._checked = len(text)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            at = text.find(stop, since)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        end = at + len(stop)
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
            # Kept by delta, the engine's step: one token each, or a step's accepted draft
            # tokens with speculative decoding, whose last ones may follow the stop string.
            kept = tokens_kept(self.offsets, cut.stop_end)
            del self.chunks[kept:], self.logprob_chunks[kept:], self.offsets[kept:]
            self.text = self.text[: cut.text_end]
            self.finish_reason, self.stop_reason = "stop", cut.stop
        elif delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


class StoppingChoices:
    """The choices of one request, streamed as deltas, each cut at the first stop string of
    its answer."""

    def __init__(self, prepared: Prepared):
        self.n = prepared.sampling.n
        self.prepared = prepared
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
                choice = self._choices[delta.index] = StreamedChoice(delta.index, stops)
            if choice.finish_reason is None:
                choice.take(delta)
        done = (c.finish_reason is not None for c in self._choices.values())
        return len(self._choices) == self.n and all(done)

    def completions(self) -> list[StreamedChoice]:
        return [self._choices[i] for i in sorted(self._choices)]
