"""Read a job request body as a stream: items are validated and copied into Postgres one by one,
so the API's memory stays flat however large the job (a whole-body parse of a 100k-item job
costs hundreds of MB per request).

Validation is the same as `JobCreate`'s: the header fields use `JobHeader`, each item `ItemIn`;
errors name the field (`items[3].messages[0].role`). The caller runs all of it inside one
transaction, so a bad item anywhere stores nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from typing import BinaryIO

import ijson
from ijson.common import ObjectBuilder
from pydantic import ValidationError

from thinkbatch.schemas import ItemIn
from thinkbatch.schemas import JobHeader

_OPEN = ("start_map", "start_array")
_CLOSE = ("end_map", "end_array")


class BodyError(Exception):
    """The body is not a JSON object of the expected shape (message, field)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _build(first: tuple[str, Any], events: Iterator[tuple[str, str, Any]]) -> Any:
    event, value = first
    if event not in _OPEN:
        return value
    builder = ObjectBuilder()
    builder.event(event, value)
    depth = 1
    for _, event, value in events:
        builder.event(event, value)
        if event in _OPEN:
            depth += 1
        elif event in _CLOSE:
            depth -= 1
            if depth == 0:
                break
    return builder.value


class _Reader:
    """ijson probes its input with read(0); werkzeug's request stream takes a zero-byte read for
    a client that went away. Answer that probe here."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream

    def read(self, size: int = -1) -> bytes:
        return b"" if size == 0 else self.stream.read(size)


def read_body(stream: BinaryIO) -> Iterator[tuple[str, Any]]:
    """Yield ("items", None) where the `items` array starts, ("item", value) for each of its
    elements and ("field", (key, value)) for every other top-level key, in body order."""
    events = ijson.parse(_Reader(stream), use_float=True)
    try:
        _, event, _ = next(events)
        if event != "start_map":
            raise BodyError("request body: Input should be an object", code="invalid_type")
        for prefix, event, value in events:
            if prefix == "" and event == "end_map":
                return
            key = value  # a top-level map_key
            _, event, value = next(events)
            if key != "items":
                yield "field", (key, _build((event, value), events))
                continue
            if event != "start_array":
                raise BodyError("items: Input should be a valid array", "items", "list_type")
            yield "items", None
            for _, event, value in events:
                if event == "end_array":
                    break
                yield "item", _build((event, value), events)
    except ijson.JSONError as error:
        raise BodyError(f"request body is not valid JSON: {error}", code="invalid_json") from None
    except StopIteration:
        raise BodyError("request body is not valid JSON: empty", code="invalid_json") from None


def validation_error(error: ValidationError, prefix: str = "") -> BodyError:
    """The first pydantic error as a message that names its field."""
    first = error.errors(include_url=False)[0]
    path = prefix
    for part in first["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in ("str", "list[str]"):  # union branch names say nothing to a user
            path += f".{part}" if path else str(part)
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return BodyError(f"{path}: {message}" if path else message, path or None, first["type"])


def parse_item(index: int, raw: Any) -> ItemIn:
    try:
        return ItemIn.model_validate(raw)
    except ValidationError as error:
        raise validation_error(error, f"items[{index}]") from None


def parse_header(fields: dict[str, Any]) -> JobHeader:
    try:
        return JobHeader.model_validate(fields)
    except ValidationError as error:
        raise validation_error(error) from None
