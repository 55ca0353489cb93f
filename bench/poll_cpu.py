"""The API's own CPU per status call, in-process (`python -m bench.poll_cpu`): the Flask app
over embedded PostgreSQL and Redis, polled through Flask's test client, so that no HTTP server
or client enters the figure. What a poll costs the app itself (authentication, the failed-auth
limiter, the job read, the live workers while the job has pending items, serialization, access
log and metrics); `make bench-scale` times the same call over HTTP.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from api import create_app
from devstack import local_stack
from thinkbatch.keys import issue_key


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=2000, help="status calls per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--items", type=int, default=1000, help="items of the polled job")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-poll-"))
    env = {"THINKBATCH_MODEL": "thinkbatch-demo"}
    with local_stack(tmp, env=env, database="poll", engine=False, demo_model=False) as local:
        settings = local.settings
        app = create_app(settings)
        key = issue_key(settings.require_database_url(), "bench", "bench.poll_cpu")
        client = app.test_client()
        client.environ_base["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        items = [{"custom_id": f"r{k}", "prompt": f"question {k}"} for k in range(args.items)]
        created = client.post("/v1/jobs", json={"items": items})
        assert created.status_code == 201 and created.json is not None, created.text
        path = f"/v1/jobs/{created.json['id']}"  # queued: it has pending items, no worker
        for _ in range(100):  # warm: statement caches, the pool, the stats cache
            client.get(path)
        rounds = []
        for _ in range(args.rounds):
            cpu = time.process_time()
            for _ in range(args.calls):
                assert client.get(path).status_code == 200
            rounds.append((time.process_time() - cpu) * 1000 / args.calls)
        services = app.extensions["thinkbatch"]  # closed before the servers stop
        services.engine.dispose()
        services.celery.close()
    print(
        f"status call of a queued {args.items}-item job, in-process: "
        f"{statistics.median(rounds):.3f} ms of CPU per call (median of {args.rounds} rounds of "
        f"{args.calls}: {' '.join(f'{r:.3f}' for r in rounds)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
