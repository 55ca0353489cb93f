"""One JSON access line per request, and the request's ids on every line logged meanwhile.

gunicorn's own access log is off (api/gunicorn.conf.py): its line is a fixed text format. This
one goes through the same formatter as every other record (thinkbatch.logging_setup), carries
`request_id` (the X-Request-ID the client sees) and, on a job's routes, `job_id`. It names the
route template and never the query string or the body.
"""

from __future__ import annotations

import logging
import time

from flask import Flask
from flask import Response
from flask import g
from flask import request

from api.errors import request_id
from thinkbatch.logging_setup import reset_context
from thinkbatch.logging_setup import set_context

log = logging.getLogger("thinkbatch.access")


def init_app(app: Flask) -> None:
    @app.before_request
    def bind_ids() -> None:
        g.thinkbatch_log_started = time.perf_counter()
        job_id = (request.view_args or {}).get("job_id")
        g.thinkbatch_log_context = set_context(request_id=request_id(), job_id=job_id)

    @app.after_request
    def access_line(response: Response) -> Response:
        started = g.get("thinkbatch_log_started")
        log.info(
            "%s %s %s",
            request.method,
            request.url_rule.rule if request.url_rule is not None else "<unmatched>",
            response.status_code,
            extra={
                "request_id": request_id(),
                "method": request.method,
                "route": request.url_rule.rule if request.url_rule is not None else None,
                "status": response.status_code,
                "duration_ms": (
                    round((time.perf_counter() - started) * 1000, 1) if started else None
                ),
                "remote_addr": request.remote_addr,
            },
        )
        return response

    @app.teardown_request
    def unbind_ids(_: BaseException | None) -> None:
        tokens = g.pop("thinkbatch_log_context", None)
        if tokens:
            try:
                reset_context(tokens)
            except ValueError:  # torn down in another context (a streamed body): nothing to undo
                pass
