"""Query parameters: parsed strictly, each error a 400 that names the parameter.

`int()` would accept `1_0`, ` 1`, `+2` and any Unicode digit (`２`); a page size or a cursor that
means something other than what was typed is a silently altered value, so only plain ASCII
digits pass here.
"""

from __future__ import annotations

import re
import uuid

from flask import Flask
from flask import request

from thinkbatch.jobs import InvalidRequest

DEFAULT_PAGE = 100
MAX_PAGE = 1000

_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only; 9 digits is far past MAX_PAGE, never a bigint
# The canonical form only: uuid.UUID() also takes braces, "urn:uuid:", no hyphens, and (through
# int(..., 16)) underscores and non-ASCII digits.
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def single(name: str) -> str | None:
    """The parameter's one value, or None when absent. Given twice, which one would win is
    a guess, so it is refused; so is a NUL, which no stored value (Postgres text) can hold."""
    values = request.args.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest(f"{name}: given {len(values)} times; give it once", param=name)
    value = values[0]
    if "\x00" in value:
        raise InvalidRequest(f"{name}: must not contain NUL (\\u0000)", param=name)
    return value


def limit() -> int:
    raw = single("limit")
    if raw is None:
        return DEFAULT_PAGE
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= MAX_PAGE:
        raise InvalidRequest(
            f"limit: must be an integer from 1 to {MAX_PAGE}, written in plain digits",
            param="limit",
        )
    return int(raw)


def job_cursor() -> str | None:
    """`after` of the job list: the id of a job (a UUID), or absent."""
    raw = single("after")
    if not raw:
        return None
    if not _UUID.fullmatch(raw):
        raise InvalidRequest("after: must be the id of a job (a UUID)", param="after")
    return str(uuid.UUID(raw))


def item_cursor() -> str | None:
    """`after` of the items page: a custom_id, or absent."""
    return single("after") or None


def status() -> str | None:
    return single("status")


def include_thinking() -> bool:
    """`include_thinking`: `true` (the default) or `false`, spelled exactly; `0`, `no`, `False`
    would be guesses at what was meant."""
    raw = single("include_thinking")
    if raw is None:
        return True
    if raw not in ("true", "false"):
        raise InvalidRequest(
            "include_thinking: must be true or false (lower case)", param="include_thinking"
        )
    return raw == "true"


def init_app(app: Flask) -> None:
    """Refuse query parameters a route does not take. A misspelt or unsupported one (`limit` on
    a route that streams everything, `offset` for `after`) would otherwise be ignored, and the
    caller would get something other than what they asked for, with a 200."""

    @app.before_request
    def refuse_unknown() -> None:
        view = app.view_functions.get(request.endpoint or "")
        doc = getattr(view, "__openapi__", None)
        if doc is None or not request.args:  # undocumented pages (dashboard, docs) take none
            return
        taken = {q.name for q in doc.query}
        for name in request.args:
            if name not in taken:
                offered = ", ".join(sorted(taken)) or "none"
                raise InvalidRequest(
                    f"{name[:64]}: unknown query parameter (this route takes: {offered})",
                    param=name[:64],
                    code="unknown_parameter",
                )
