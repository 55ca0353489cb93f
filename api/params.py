"""Query parameters: parsed strictly, each error a 400 that names the parameter. Every route
that pages (jobs, items, files, batches) takes its `limit` and `after` from here.

`int()` would accept `1_0`, ` 1`, `+2` and any Unicode digit (`２`); a page size or a cursor that
means something other than what was typed is a silently altered value, so only plain ASCII
digits pass here.
"""

from __future__ import annotations

import re
import uuid

from flask import Flask
from flask import request

from thinkbatch.errors import InputError
from thinkbatch.guard import check_text

DEFAULT_PAGE = 100
MAX_PAGE = 1000

_DIGITS = re.compile(r"[0-9]{1,9}")  # ASCII only; 9 digits is far past MAX_PAGE, never a bigint
# The canonical form only: uuid.UUID() also takes braces, "urn:uuid:", no hyphens, and (through
# int(..., 16)) underscores and non-ASCII digits.
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def single(name: str) -> str | None:
    """The parameter's one value, or None when absent. Given twice, which one would win is
    a guess, so it is refused; so is a NUL, which no stored value (Postgres text) can hold, and
    an empty value (`?status=`), which would otherwise read as the parameter left out: every
    item where the caller asked for some."""
    values = request.args.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise InputError(f"{name}: given {len(values)} times; give it once", param=name)
    if not values[0]:
        raise InputError(f"{name}: empty; give a value or leave the parameter out", param=name)
    return check_text(values[0], name)


def limit(default: int = DEFAULT_PAGE, most: int = MAX_PAGE) -> int:
    """`limit`: a page size from 1 to `most`, `default` when absent."""
    raw = single("limit")
    if raw is None:
        return default
    if not _DIGITS.fullmatch(raw) or not 1 <= int(raw) <= most:
        raise InputError(
            f"limit: must be an integer from 1 to {most}, written in plain digits",
            param="limit",
        )
    return int(raw)


def after() -> str | None:
    """`after`: the last id of the page before (its kind is the route's to check), or None."""
    return single("after")


def job_cursor() -> uuid.UUID | None:
    """`after` of the job list: the id of a job (a UUID), or absent."""
    raw = after()
    if raw is None:
        return None
    if not _UUID.fullmatch(raw):
        raise InputError("after: must be the id of a job (a UUID)", param="after")
    return uuid.UUID(raw)


def status() -> str | None:
    return single("status")


def include_thinking() -> bool:
    """`include_thinking`: `true` (the default) or `false`, spelled exactly; `0`, `no`, `False`
    would be guesses at what was meant."""
    raw = single("include_thinking")
    if raw is None:
        return True
    if raw not in ("true", "false"):
        raise InputError(
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
                raise InputError(
                    f"{name[:64]}: unknown query parameter (this route takes: {offered})",
                    param=name[:64],
                    code="unknown_parameter",
                )
