"""A field that takes one boolean value, strictly: `true` only, or `false` only.

Pydantic's strict mode does not reach a `Literal[True]`, which compares by equality, so 1 and
1.0 passed as `true` and 0 as `false`: a value silently read as another. These fields check the
JSON type first, as every other boolean of the wire models is checked.
"""

from __future__ import annotations

from typing import Annotated
from typing import Any
from typing import Literal

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError


def _a_bool(value: Any) -> Any:
    if type(value) is not bool:
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


OnlyTrue = Annotated[Literal[True], BeforeValidator(_a_bool)]
OnlyFalse = Annotated[Literal[False], BeforeValidator(_a_bool)]
