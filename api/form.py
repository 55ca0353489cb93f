"""The upload form of `POST /v1/files`, parsed with werkzeug's multipart decoder.

werkzeug's request form parser is silent: a body cut off half-way gives an empty form, and too
many parts is reported as a body over its size limit. Its decoder (the same code, one level
down) reports each event, so every fault here is named for what it is: a body that ends before
its closing boundary, too many parts, an oversized or non-UTF-8 field.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from dataclasses import field
from typing import IO

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.sansio.multipart import Data
from werkzeug.sansio.multipart import Epilogue
from werkzeug.sansio.multipart import Field
from werkzeug.sansio.multipart import File
from werkzeug.sansio.multipart import MultipartDecoder
from werkzeug.sansio.multipart import NeedData

from thinkbatch.errors import InputError

# An upload is `file`, `purpose` and the two `expires_after` fields; a form of more parts than
# this is no upload of this API (and each part costs memory while it is decoded).
MAX_PARTS = 16
# A field other than a file holds a short value (a purpose, a number of seconds).
MAX_FIELD_BYTES = 64 * 1024
_READ = 64 * 1024


@dataclass
class Part:
    name: str
    filename: str | None
    data: IO[bytes]  # rewound


@dataclass
class Form:
    fields: dict[str, list[str]] = field(default_factory=dict)
    files: list[Part] = field(default_factory=list)

    def close(self) -> None:
        for part in self.files:
            part.data.close()


def parse(stream: IO[bytes], boundary: str, *, spool_memory_bytes: int) -> Form:
    """The form's fields and files; InputError naming what is wrong with it."""
    if not boundary:
        raise InputError(
            "body: multipart/form-data needs a boundary in its Content-Type",
            code="invalid_multipart",
        )
    decoder = MultipartDecoder(boundary.encode("latin-1"), max_form_memory_size=None)
    form = Form()
    current: Part | None = None
    field_name: str | None = None
    field_data = bytearray()
    parts = 0
    finished = False
    try:
        while not finished:
            chunk = stream.read(_READ)
            decoder.receive_data(chunk or None)
            while True:
                try:
                    event = decoder.next_event()
                except ValueError:
                    if chunk:
                        raise
                    event = NeedData()  # the end came in the middle of a part: cut off
                if isinstance(event, NeedData):
                    break
                if isinstance(event, Epilogue):
                    finished = True
                    break
                if isinstance(event, File | Field):
                    parts += 1
                    if parts > MAX_PARTS:
                        raise InputError(
                            f"body: the form has more than {MAX_PARTS} parts; an upload takes "
                            "`file`, `purpose` and `expires_after`",
                            code="too_many_parts",
                        )
                    if isinstance(event, File):
                        spool = tempfile.SpooledTemporaryFile(max_size=spool_memory_bytes)  # noqa: SIM115
                        current = Part(event.name, event.filename, spool)
                        form.files.append(current)
                        field_name = None
                    else:
                        current, field_name = None, event.name
                        field_data.clear()
                elif isinstance(event, Data):
                    if current is not None:
                        current.data.write(event.data)
                    elif field_name is not None:
                        field_data += event.data
                        if len(field_data) > MAX_FIELD_BYTES:
                            raise InputError(
                                f"{field_name[:64]}: longer than {MAX_FIELD_BYTES} bytes",
                                param=field_name[:64],
                            )
                        if not event.more_data:
                            form.fields.setdefault(field_name, []).append(
                                _text(field_name, bytes(field_data))
                            )
                            field_name = None
            if not chunk and not finished:
                raise InputError(
                    "body: the multipart body ends before its closing boundary (cut off?)",
                    code="invalid_multipart",
                )
    except ValueError as error:  # the decoder's own word on a malformed body
        form.close()
        raise InputError(
            f"body: malformed multipart/form-data: {error}", code="invalid_multipart"
        ) from None
    except (InputError, RequestEntityTooLarge):
        form.close()
        raise
    for part in form.files:
        part.data.seek(0)
    return form


def _text(name: str, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{name[:64]}: not UTF-8 text", param=name[:64]) from None
