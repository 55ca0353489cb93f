"""The errors the job service and its facades raise for a caller to see: one family for bad
input (what is wrong, which field, a code), and the absent and the conflicting. The API turns
each into its one envelope (api/errors.py); a batch file's line errors are the same kind, with
the line number added by whoever read the line."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

# The codes of an item the engine refused as a request (worker.engine.ItemRejected): the
# request itself can never run, so a retry, the worker's or a client's, gets the same refusal.
# The OpenAI error file answers them 400, as it answers the refusals at submit.
RejectionCode = Literal["invalid_request", "template_error", "grammar_error", "prompt_too_long"]
REJECTION_CODES: frozenset[str] = frozenset(RejectionCode.__args__)  # type: ignore[attr-defined]


class InputError(Exception):
    """The request (a body, a field, a line of a file) is not acceptable: a 4xx, never a 5xx.

    `param` names the field at fault (`items[3].messages[0].role`, `body.seed`), `code` says
    what kind of fault it is, `status` is the HTTP status it answers (400 unless a limit of
    size says 413)."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str = "invalid_value",
        status: int = 400,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status

    def renamed(self, old: str, new: str | None) -> InputError:
        """The same error with its field `old` (a prefix of its param) called `new`: an item
        check in the terms of the line that carried the item (`items[0].prompt` is
        `body.prompt` there)."""
        param = self.param or ""
        if not param.startswith(old):
            return self
        rest = param[len(old) :]
        renamed = f"{new}{rest}" if new is not None else (rest.lstrip(".") or None)
        message = self.message
        if message.startswith(param):
            message = (renamed or "") + message[len(param) :]
            message = message.lstrip(": ") if renamed is None else message
        return InputError(message, param=renamed, code=self.code, status=self.status)


class NotFound(Exception):
    """No such thing for this caller (another tenant's is as absent as one never made)."""

    kind = "job"

    def __init__(self, ident: str, *, param: str | None = None):
        super().__init__(ident)
        self.ident = ident
        self.param = param  # the request's field that named it, when it came in a body

    @property
    def code(self) -> str:
        return f"{self.kind}_not_found"


class FileNotFound(NotFound):
    kind = "file"


class BatchNotFound(NotFound):
    kind = "batch"


class Conflict(Exception):
    """The request cannot apply to the thing as it is now (cancelling a finished job)."""


class ApiError(BaseModel):
    """Every 4xx/5xx body: `{"error": {"type", "code", "message", "param"}}` (OpenAI's shape)."""

    class Body(BaseModel):
        type: Literal[
            "invalid_request_error",
            "authentication_error",
            "rate_limit_error",
            "not_found",
            "conflict",
            "unavailable",
            "server_error",
        ]
        code: str
        message: str
        param: str | None = None

    error: Body
