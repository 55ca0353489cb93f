"""One OpenAI batch input line as an item: sampling fields reach the item's params, and a value
the engine would refuse names its field under `body.`."""

from __future__ import annotations

import json

import pytest

from thinkbatch.errors import InputError
from thinkbatch.guard import Limits
from thinkbatch.openai.lines import CHAT
from thinkbatch.openai.lines import parse_line

LINE = Limits(max_depth=32, items_key=None)


def line(**body: object) -> bytes:
    return json.dumps(
        {
            "custom_id": "a",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body},
        }
    ).encode()


def test_frequency_penalty_reaches_the_item() -> None:
    parsed = parse_line(line(frequency_penalty=0.5, presence_penalty=-0.5), CHAT, LINE)
    assert parsed.item.params is not None
    assert parsed.item.params.frequency_penalty == 0.5
    assert parsed.item.params.presence_penalty == -0.5


@pytest.mark.parametrize("value", [2.5, -3, "0.5"])
def test_a_frequency_penalty_the_engine_refuses_names_its_field(value: object) -> None:
    with pytest.raises(InputError) as error:
        parse_line(line(frequency_penalty=value), CHAT, LINE)
    assert error.value.param == "body.frequency_penalty"
