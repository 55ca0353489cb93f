"""The worker container's health check: `python -m worker.healthcheck`.

A worker serves its Prometheus /metrics only once its engine is loaded (worker/lifecycle.py), so
an answer there means the engine is up. The port and address are the worker's own settings
(THINKBATCH_WORKER_METRICS_PORT, _HOST), read here as the worker reads them, so that a port
changed in `.env` cannot leave a health check knocking on the old one. Exit 0: healthy.
"""

from __future__ import annotations

import sys
import urllib.request

from thinkbatch.settings import Settings

# A worker listening on every address answers on loopback.
ANY_ADDRESS = ("", "0.0.0.0", "::")  # noqa: S104 - compared with, never bound


def metrics_url(settings: Settings) -> str | None:
    """Where the worker's /metrics answers; None when its metrics port is off."""
    if settings.worker_metrics_port == 0:
        return None
    host = settings.worker_metrics_host
    host = "127.0.0.1" if host in ANY_ADDRESS else host
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"http://{host}:{settings.worker_metrics_port}/metrics"


def main() -> int:
    url = metrics_url(Settings())
    if url is None:
        print("THINKBATCH_WORKER_METRICS_PORT is 0: the worker serves no metrics, so its health")
        print("cannot be read; set a port to have it checked")
        return 1
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - http, ours
            response.read(1)
    except OSError as error:
        print(f"{url}: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
