"""gunicorn settings of the API, shared by the launcher, the container image and the docs:
`gunicorn -c api/gunicorn.conf.py api.wsgi:app` (add `--bind` as needed).

Threads (gthread), not the sync workers: a sync worker is one request at a time, so two clients
that stall half-way through their bodies took both default workers and every other request
waited out the timeout. A thread per request keeps the rest served, and api.body bounds how long
a thread waits on a silent client (REQUEST_READ_TIMEOUT_S).
"""

from thinkbatch.settings import Settings

_settings = Settings()

worker_class = "gthread"
workers = _settings.api_workers
threads = _settings.api_threads
# With threads the worker's main loop answers the arbiter while requests run, so this only
# catches a wedged process; a long results download is not cut off by it.
timeout = 300
graceful_timeout = 30
keepalive = 5
accesslog = "-"
bind = ["0.0.0.0:8000"]
