"""Which of a process's two pools of threads serves a request: the quick lane (API_THREADS) or
the bulk lane (API_BULK_THREADS).

Bulk requests are those whose work grows with a job or a file: a results download and a file's
contents (made at the database's pace, however fast the client reads: api/bridge.py), a job's
timeline on the dashboard, a batch's create (it validates its whole input file) and any request
whose body is large (a submit of thousands of items, an upload). They take their own threads,
so a status call, a page, a listing or `/healthz` never waits for a thread behind them, however
many run at once; and each lane keeps few threads, where one large pool for both made every
request dearer: on the 2-core host of docs/performance.md, 16 threads cost each request of
`make bench-scale`'s load run about a fifth more API CPU than 4 (the threads' contention for
the interpreter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.intake import declared_length

# A body larger than this makes its request bulk: a submit of about a thousand plain items.
BULK_BODY_BYTES = 256 * 1024
# GET /v1/jobs/{id}/results, /v1/files/{id}/content, and the dashboard's /jobs/{id}/timeline
# (every finished item's time, plotted).
_BULK_READS = ("/results", "/content", "/timeline")
_BULK_POSTS = ("/v1/batches",)


def is_bulk(scope: Mapping[str, Any]) -> bool:
    """Whether the request goes to the bulk lane. Its body, if any, is in full by now
    (api/intake.py), and its Content-Length is the body's exact size."""
    method, path = str(scope.get("method", "")), str(scope.get("path", ""))
    if method in ("GET", "HEAD"):
        return path.endswith(_BULK_READS)
    if method == "POST" and path in _BULK_POSTS:
        return True
    length, _ = declared_length(scope)
    return length is not None and length > BULK_BODY_BYTES
