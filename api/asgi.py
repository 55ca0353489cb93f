"""gunicorn entry point: `gunicorn -c api/gunicorn.conf.py api.asgi:app`.

The server is gunicorn's asyncio worker: request bodies are received by its event loop
(api.intake), and only complete requests reach the Flask app, which a2wsgi runs on
two pools of threads (API_THREADS for quick requests, API_BULK_THREADS for bulk ones:
api.lanes), its responses handed back in batches (api.bridge); asgiref's bridge would run
every request on one thread.
"""

from typing import Any
from typing import cast

from api import create_app
from api.bridge import BatchedWSGIMiddleware
from api.intake import Intake
from thinkbatch import logging_setup
from thinkbatch.settings import get_settings

_settings = get_settings()
# Each gunicorn worker logs JSON lines (LOG_FORMAT) through the root logger; gunicorn's own
# loggers are set up the same way in api/gunicorn.conf.py.
logging_setup.configure(_settings, "api")
# The casts bridge two spellings of the same callables: a2wsgi's own WSGI and ASGI types, and
# Flask's and ours (api.intake), which are looser.
_flask: Any = create_app(_settings)
_bridge = BatchedWSGIMiddleware(
    _flask,
    workers=_settings.api_threads,
    bulk_workers=_settings.api_bulk_threads,
    spool_max_bytes=_settings.response_spool_max_bytes,
)
app = Intake(cast(Any, _bridge), _settings)
