"""The thinking/answer split and reasoning-token count, for every Qwen3 output shape."""

from __future__ import annotations

import pytest

from thinkbatch.thinking import count_reasoning_tokens
from thinkbatch.thinking import prompt_closes_thinking
from thinkbatch.thinking import prompt_opens_thinking
from thinkbatch.thinking import split_thinking

START, END, TURN, EOS = 3, 4, 1, 2


@pytest.mark.parametrize(
    ("text", "opened", "thinking", "answer", "truncated"),
    [
        # Qwen3 hybrid, thinking on.
        ("<think>\nweigh options\n</think>\n\nPick B.", False, "weigh options", "Pick B.", False),
        # Thinking off: the template closed an empty block in the prompt.
        ("Pick B.", False, "", "Pick B.", False),
        # Thinking-2507 templates open <think> in the prompt: only the close is generated.
        ("weigh options\n</think>\n\nPick B.", True, "weigh options", "Pick B.", False),
        # Cut by max_tokens inside the thinking.
        ("<think>\nweigh opt", False, "weigh opt", "", True),
        ("weigh opt", True, "weigh opt", "", True),
        # A closed but empty thinking block (the model chose not to think).
        ("<think>\n\n</think>\n\nPick B.", False, "", "Pick B.", False),
        # Cut right after the thinking: empty answer, but the thinking is complete.
        ("<think>\nweigh\n</think>", False, "weigh", "", False),
        # Leading whitespace before <think>.
        ("\n<think>a</think>b", False, "a", "b", False),
        # Only the first </think> splits; a later one belongs to the answer.
        ("<think>a</think>b </think> c", False, "a", "b </think> c", False),
        ("", False, "", "", False),
        # The answer is kept as generated, save the line breaks after </think>: a leading
        # space, indentation, trailing text and a kept stop string all stay.
        (" Paris, France", False, "", " Paris, France", False),
        (
            "<think>t</think>\n\n    def f():\n        pass\n",
            False,
            "t",
            "    def f():\n        pass\n",
            False,
        ),
        ("<think>t</think>\n\nDone. END", False, "t", "Done. END", False),
        ("<think>t</think> spaced", False, "t", " spaced", False),
        ("\n\nno thinking at all\n", False, "", "\n\nno thinking at all\n", False),
    ],
)
def test_split(text: str, opened: bool, thinking: str, answer: str, truncated: bool) -> None:
    split = split_thinking(text, opened_in_prompt=opened)
    assert (split.thinking, split.answer, split.truncated) == (thinking, answer, truncated)
    # Nothing of the answer is lost: the separator and the answer are what followed </think>.
    if "</think>" in text:
        assert text.split("</think>", 1)[1] == split.separator + split.answer


@pytest.mark.parametrize(
    ("ids", "opened", "expected"),
    [
        ([START, 10, 11, END, 20, 21, EOS], False, 4),  # tags count as thinking tokens
        ([20, 21, EOS], False, 0),  # thinking off
        ([10, 11, END, 20, EOS], True, 3),  # 2507: the open tag was in the prompt
        ([START, 10, 11, 12], False, 4),  # truncated inside thinking: all of it
        ([10, 11, 12], True, 3),
        ([], False, 0),
    ],
)
def test_count_reasoning_tokens(ids: list[int], opened: bool, expected: int) -> None:
    got = count_reasoning_tokens(ids, start_id=START, end_id=END, opened_in_prompt=opened)
    assert got == expected


def test_count_without_known_ids_is_zero() -> None:
    assert count_reasoning_tokens([1, 2, 3], start_id=None, end_id=None) == 0


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([TURN, 50, 51, TURN, 60, START, 70], True),  # the template opened thinking
        ([TURN, 60, START, 70, 70, END, 70, 70], False),  # thinking off: closed in the prompt
        ([TURN, 50, START, 51, TURN, 60], False),  # a <think> in an earlier turn does not count
        ([TURN, 60], False),
        ([50, START], True),  # a raw prompt that ends inside <think>
    ],
)
def test_prompt_opens_thinking(ids: list[int], expected: bool) -> None:
    assert prompt_opens_thinking(ids, start_id=START, end_id=END, turn_start_id=TURN) is expected


@pytest.mark.parametrize(
    ("ids", "expected"),
    [
        ([TURN, 60, START, 70, 70, END, 70, 70], True),  # thinking off: closed in the prompt
        ([TURN, 50, 51, TURN, 60, START, 70], False),  # opened: the model thinks
        # A template that ignores enable_thinking writes no block: the model may think.
        ([TURN, 50, 51, TURN, 60], False),
        ([TURN, 50, START, 51, END, TURN, 60], False),  # closed in an earlier turn only
        ([50, 51], False),
    ],
)
def test_prompt_closes_thinking(ids: list[int], expected: bool) -> None:
    assert prompt_closes_thinking(ids, start_id=START, end_id=END, turn_start_id=TURN) is expected
