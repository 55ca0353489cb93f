"""Log lines of the API and the worker: JSON lines (LOG_FORMAT=json) or plain text.

python-json-logger (pinned in pyproject) does the formatting: it is maintained, plugs into the
stdlib `logging` that Celery, gunicorn, SQLAlchemy and vLLM already log through (structlog
would need its ProcessorFormatter bridge for all of them), and puts every `extra` field of a
record into the line. What this module adds is context: `job_id`, `item_id` and `request_id`
are held in context variables (`bind`), and a filter copies them onto each record logged
meanwhile, in that thread or task.

No prompt or answer text is logged at any level: the code logs ids, counts and error types,
never item content, and the context carries ids only.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from collections.abc import Iterator
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from thinkbatch.settings import Settings

CONTEXT_FIELDS = ("job_id", "item_id", "request_id")
_context: dict[str, contextvars.ContextVar[Any]] = {
    name: contextvars.ContextVar(name, default=None) for name in CONTEXT_FIELDS
}
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
_MARK = "_thinkbatch_handler"


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Attach ids (job_id, item_id, request_id) to every record logged inside the block."""
    tokens = [(_context[k], _context[k].set(str(v))) for k, v in fields.items() if v is not None]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_context(**fields: Any) -> list[tuple[contextvars.ContextVar[Any], Any]]:
    """`bind` for hooks that cannot wrap a block (Flask's before/teardown request)."""
    return [(_context[k], _context[k].set(str(v))) for k, v in fields.items() if v is not None]


def reset_context(tokens: list[tuple[contextvars.ContextVar[Any], Any]]) -> None:
    for var, token in reversed(tokens):
        var.reset(token)


class ContextFilter(logging.Filter):
    """Copies the bound ids onto a record (an `extra=` of the call itself wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for name, var in _context.items():
            value = var.get()
            if value is not None and not hasattr(record, name):
                setattr(record, name, value)
        return True


def formatter(settings: Settings, component: str) -> logging.Formatter:
    if settings.log_format == "text":
        return logging.Formatter(TEXT_FORMAT)
    return JsonFormatter(
        "{asctime}{levelname}{name}{message}{process}{threadName}",
        style="{",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        static_fields={"component": component},
    )


def configure(settings: Settings, component: str, stream: Any = None) -> logging.Handler:
    """Send the root logger's records to `stream` (stderr) in LOG_FORMAT. Idempotent: a handler
    this function installed before is replaced, handlers of others (pytest's) are kept."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream or sys.stderr)
    setattr(handler, _MARK, True)
    handler.setFormatter(formatter(settings, component))
    handler.addFilter(ContextFilter())
    root.addHandler(handler)
    root.setLevel(settings.log_level)
    return handler
