"""gunicorn settings of the API, shared by the launcher, the container image and the docs:
`gunicorn -c api/gunicorn.conf.py api.asgi:app` (add `--bind` as needed).

gunicorn's asyncio worker, not its thread or sync workers: with a thread per request, a client
that sends its body slowly holds that thread for as long as it trickles, and a few dozen such
clients took every thread of the API. Here bodies are received by the event loop (api/intake.py)
and only complete requests reach the app's threads (api/asgi.py).
"""

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from gunicorn.glogging import Logger

from thinkbatch.settings import get_settings

_settings = get_settings()

# Metrics of all worker processes (api/metrics.py): prometheus-client's multiprocess mode reads
# PROMETHEUS_MULTIPROC_DIR when it is imported, which happens in each worker after the fork,
# so setting it here (in the master, before any worker starts) reaches them all. The directory
# is wiped at every start: files of a previous run would add stale counts.
_own_metrics_dir = _settings.prometheus_multiproc_dir is None
_metrics_dir: Path = _settings.prometheus_multiproc_dir or Path(
    tempfile.mkdtemp(prefix="thinkbatch-api-metrics-")
)
shutil.rmtree(_metrics_dir, ignore_errors=True)
Path(_metrics_dir).mkdir(parents=True, exist_ok=True)
os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(_metrics_dir)


# gunicorn's server hooks: gunicorn ships no type information, so its arbiter and worker are Any.
def child_exit(server: Any, worker: Any) -> None:
    """A worker that exits leaves its gauge files behind; mark them dead (counters stay)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)  # type: ignore[no-untyped-call]


def on_exit(server: Any) -> None:
    if _own_metrics_dir:
        shutil.rmtree(_metrics_dir, ignore_errors=True)


# gunicorn's asyncio worker, with a bound on connections and on a first request's headers.
worker_class = "api.server.Worker"
workers = _settings.api_workers
# The app's threads are a2wsgi's pools (api/asgi.py); the asyncio worker takes no `threads`.
# Connections, idle or receiving a body, cost a socket and a coroutine each; those over this
# bound are closed as they come (api/server.py).
worker_connections = _settings.api_max_connections
# The event loop answers the arbiter while requests run, so this only catches a wedged
# process; a long results download is not cut off by it.
timeout = 300
graceful_timeout = 30
# Longer than clients' and proxies' own idle timeouts (API_KEEPALIVE_S): the side that closes an
# idle connection first must be the client, or a request it sends just then is lost.
keepalive = _settings.api_keepalive_s
# One JSON access line per request comes from the app (api/access_log.py, with the request
# id); gunicorn's own lines (start, worker exits) go through the same formatter.
accesslog = None


class AppLogsAccess(Logger):  # type: ignore[misc]  # gunicorn is untyped
    """gunicorn's logger without its access line. With a `logconfig_dict` (below) gunicorn
    counts its access log as enabled, whatever `accesslog` says, and builds each request's
    line (a dict of every header and environ entry, the time formatted) before the WARNING
    level of `gunicorn.access` drops it, on every request."""

    def _compute_access_log_enabled(self) -> bool:
        return False


logger_class = AppLogsAccess
logconfig_dict = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {
            "()": "thinkbatch.logging_setup.formatter",
            "settings": _settings,
            "component": "api",
        }
    },
    "handlers": {
        "stderr": {
            "class": "logging.StreamHandler",
            "formatter": "json",
            "stream": "ext://sys.stderr",
        }
    },
    # The root logger gets its handler in each worker (api/asgi.py), not twice.
    "root": {"level": "INFO", "handlers": []},
    "loggers": {
        "gunicorn.error": {"handlers": ["stderr"], "level": "INFO", "propagate": False},
        "gunicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
    },
}
bind = ["0.0.0.0:8000"]
