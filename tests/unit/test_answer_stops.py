"""Stop strings end the answer, never the thinking: where the answer starts as the text grows,
the cut vLLM would make there, and choices put together from an engine's deltas."""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from thinkbatch.sampling import resolve_sampling
from thinkbatch.thinking import answer_start
from thinkbatch.thinking import split_thinking
from worker.answer_stops import AnswerStops
from worker.answer_stops import StoppingChoices
from worker.engine import Prepared

THOUGHT = "<think>\nThe user wants a list.\n\nAnswer: one line each.\n</think>\n\n"


@pytest.mark.parametrize(
    ("text", "opened", "start"),
    [
        ("", False, None),
        ("<th", False, None),  # may be the opening tag
        ("<think>\nplanning", False, None),
        ("<think>\nplanning</think>", False, None),
        ("<think>\nplanning</think>\n\n", False, None),  # the line breaks are not the answer
        ("<think>\nx</think>\n\n Hi", False, len("<think>\nx</think>\n\n")),
        ("planning\n</think>\nHi", True, len("planning\n</think>\n")),
        ("planning", True, None),
        ("Hi there", False, 0),  # no thinking: all of it is the answer
        ("  <b>bold", False, 0),
    ],
)
def test_the_answer_starts_where_the_split_puts_it(
    text: str, opened: bool, start: int | None
) -> None:
    assert answer_start(text, opened_in_prompt=opened) == start
    if start is not None:
        assert text[start:] == split_thinking(text, opened_in_prompt=opened).answer


def feed_by_char(stops: AnswerStops, text: str) -> tuple[int, Any]:
    """Feed `text` a character at a time; (characters fed, the cut) at the first cut."""
    for k in range(1, len(text) + 1):
        cut = stops.feed(text[:k])
        if cut is not None:
            return k, cut
    return len(text), None


@pytest.mark.parametrize(
    ("stop", "answer"),
    [("\n\n", "First line."), ("\n", "First line."), ("Answer:", "First line.\n\n")],
)
def test_a_stop_string_in_the_thinking_is_left_alone_and_the_answer_is_cut_at_it(
    stop: str, answer: str
) -> None:
    text = THOUGHT + "First line.\n\nAnswer: the second."
    fed, cut = feed_by_char(AnswerStops([stop], opened_in_prompt=False, keep=False), text)
    assert cut is not None and text[len(THOUGHT) : cut.text_end] == answer
    assert cut.stop_end == len(THOUGHT) + len(answer) + len(stop)
    assert fed == cut.stop_end  # found as soon as it is complete


def test_the_earliest_stop_in_the_answer_wins_and_may_be_kept() -> None:
    text = THOUGHT + "alpha END beta STOP"
    stops = AnswerStops(["STOP", "END"], opened_in_prompt=False, keep=True)
    _, cut = feed_by_char(stops, text)
    assert text[len(THOUGHT) : cut.text_end] == "alpha END" and cut.stop == "END"


def test_a_stop_string_split_across_deltas_is_found() -> None:
    stops = AnswerStops(["<END>"], opened_in_prompt=False, keep=False)
    text = "no thinking here <E"
    assert stops.feed(text) is None
    cut = stops.feed(text + "ND> more")
    assert cut is not None and cut.text_end == len("no thinking here ")


def test_unclosed_thinking_is_never_cut() -> None:
    stops = AnswerStops(["e"], opened_in_prompt=True, keep=False)
    assert feed_by_char(stops, "the thinking goes on and on")[1] is None


def delta(index: int, text: str, ids: list[int], finish: str | None = None) -> Any:
    return SimpleNamespace(
        index=index,
        text=text,
        token_ids=ids,
        logprobs=[{i: i} for i in ids],
        finish_reason=finish,
        stop_reason=None,
    )


VOCAB = {1: "<think>\n", 2: "hm\n", 3: "</think>", 4: "\n\n", 5: "Yes", 6: ".\n", 7: "more",
         9: "No stop", 10: " in me", 11: ".", 12: "Hi", 13: "!", 14: " later"}  # fmt: skip


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def choices_of(params: dict[str, Any]) -> StoppingChoices:
    sampling = resolve_sampling(params, None, default_max_tokens=9)
    prepared = Prepared(
        prompt_ids=[1], opened_in_prompt=False, sampling=sampling, answer_stops=sampling.stop
    )
    return StoppingChoices(prepared, decode)


def test_choices_from_deltas_end_each_at_its_stop_and_all_end_together() -> None:
    choices = choices_of({"stop": "\n", "n": 2, "logprobs": True})
    assert not choices.add([delta(0, decode([1, 2, 3, 4]), [1, 2, 3, 4])])
    assert not choices.add([delta(0, "Yes", [5]), delta(1, "No stop in me", [9, 10])])
    # Choice 0's stop arrives with a token after it in one delta (vLLM merges the deltas a
    # busy loop has not taken): that token is not kept, as vLLM keeps none after the stop.
    assert not choices.add([delta(0, ".\nmore", [6, 7])])
    assert choices.add([delta(1, ".", [11], "length")])
    first, second = choices.completions()
    assert first.text == "<think>\nhm\n</think>\n\nYes."
    assert (first.token_ids, first.finish_reason, first.stop_reason) == (
        [1, 2, 3, 4, 5, 6], "stop", "\n")  # fmt: skip
    assert first.logprobs == [{i: i} for i in first.token_ids]
    assert (second.text, second.token_ids, second.finish_reason) == (
        "No stop in me.", [9, 10, 11], "length")  # fmt: skip


def test_deltas_after_a_choice_is_cut_are_not_taken() -> None:
    choices = choices_of({"stop": ["!"]})
    assert choices.add([delta(0, "Hi!", [12, 13])])
    choices.add([delta(0, " later", [14], "abort")])
    (only,) = choices.completions()
    assert (only.text, only.token_ids, only.finish_reason) == ("Hi", [12, 13], "stop")


def test_of_several_stops_the_one_that_ends_first_wins_as_in_vllm() -> None:
    # "cd" ends before "abcdef" does, though "abcdef" starts first.
    stops = AnswerStops(["abcdef", "cd"], opened_in_prompt=False, keep=False)
    cut = stops.feed("abcdef")
    assert cut is not None and (cut.stop, cut.text_end) == ("cd", 2)
    # Ending together: the first listed.
    cut = AnswerStops(["bc", "abc"], opened_in_prompt=False, keep=False).feed("xabc")
    assert cut is not None and cut.stop == "bc"


@pytest.mark.parametrize(
    ("text", "opened"),
    [
        (THOUGHT + "First line.", False),
        ("  <think>x</think>\r\n\r\nA", False),
        ("thought\n</think>\n\nA and more", True),
        ("plain answer", False),
        ("<think>never closed", False),
        ("Hi</think>\n\nAnswer", False),  # a close without an open: the answer follows it
        ("</think>answer", False),
        ("\n\n  </thi", False),
    ],
)
def test_the_answer_is_found_as_the_text_grows_where_the_split_puts_it(
    text: str, opened: bool
) -> None:
    rng = random.Random(7)  # noqa: S311 - delta sizes, seeded: the same splits every run
    for split in range(30):  # a character at a time, then in random deltas
        stops = AnswerStops(["\x00"], opened_in_prompt=opened, keep=False)
        k = 0
        while k <= len(text):
            got = stops.answer_from(text[:k])
            assert got == answer_start(text[:k], opened_in_prompt=opened), (split, k)
            k += 1 if split == 0 else rng.randint(1, 6)


def test_a_close_without_an_open_moves_the_answer_past_it() -> None:
    stops = AnswerStops(["\n\n"], opened_in_prompt=False, keep=False)
    assert stops.feed("Hi") is None
    text = "Hi</think>\n\nAnswer\n\nmore"
    cut = stops.feed(text)
    assert cut is not None and text[: cut.text_end] == "Hi</think>\n\nAnswer"


def test_a_merged_delta_keeps_the_tokens_up_to_the_one_completing_the_stop() -> None:
    # Byte tokens, as a byte-level vocabulary splits an emoji: the stop is complete only with
    # the emoji's last byte, and the detokenizer holds a partial character back.
    sampling = resolve_sampling({"stop": "😀"}, None, default_max_tokens=9)
    prepared = Prepared(
        prompt_ids=[1], opened_in_prompt=False, sampling=sampling, answer_stops=sampling.stop
    )
    choices = StoppingChoices(prepared, lambda ids: bytes(ids).decode(errors="replace"))
    merged = list("A😀yz".encode())
    assert not choices.add([delta(0, "x", [ord("x")])])
    assert choices.add([delta(0, "A😀yz", merged)])
    (only,) = choices.completions()
    assert only.text == "xA" and only.stop_reason == "😀"
    assert only.token_ids == [ord("x"), *"A😀".encode()]  # vLLM's six: none after the stop
