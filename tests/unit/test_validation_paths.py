"""An error's `param` is the path of the user's own field: never the tag pydantic gives a branch
of a union (`literal['none','auto','required']`, a model's class name, `list[...]`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from thinkbatch.guard import validation_error
from thinkbatch.jobs import SamplingParamsIn


def refusal(data: dict[str, Any], *, with_input: bool = True) -> tuple[str | None, str]:
    with pytest.raises(ValidationError) as error:
        SamplingParamsIn.model_validate(data)
    found = (
        validation_error(error.value, "params", data)
        if with_input
        else validation_error(error.value, "params")
    )
    return found.param, found.message


@pytest.mark.parametrize("with_input", [True, False])
@pytest.mark.parametrize(
    ("data", "param", "words"),
    [
        ({"tool_choice": "sometimes"}, "params.tool_choice", "'none', 'auto' or 'required'"),
        ({"tool_choice": 5}, "params.tool_choice", "'none', 'auto' or 'required'"),
        ({"tool_choice": {"type": "function", "function": {}}},
         "params.tool_choice.function.name", "Field required"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}, "x": 1}},
         "params.tool_choice.x", "Extra inputs"),
        ({"stop": ["a", ""]}, "params.stop[1]", "non-empty"),
        ({"stop": ""}, "params.stop", "non-empty"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
         "params.response_format.json_schema.schema", "valid dictionary"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "params.tools[0].function.name", "pattern"),
    ],
)  # fmt: skip
def test_the_param_is_the_users_path(
    data: dict[str, Any], param: str, words: str, with_input: bool
) -> None:
    got_param, message = refusal(data, with_input=with_input)
    assert got_param == param
    assert message.startswith(f"{param}: ") and words in message
    for tag in ("literal[", "NamedToolChoice", "list[", "function-after", "str"):
        assert tag not in got_param.replace("params.stop", "")


def test_a_users_key_that_reads_like_a_type_is_kept_when_the_input_is_known() -> None:
    # A logit_bias key is the user's own text: with the input at hand it is never taken for a
    # branch's tag, whatever it looks like.
    param, _ = refusal({"logit_bias": {"NamedToolChoice": 1}})
    assert param == "params.logit_bias.NamedToolChoice"
