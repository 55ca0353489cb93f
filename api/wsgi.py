"""gunicorn entry point: `gunicorn api.wsgi:app`."""

from api import create_app
from thinkbatch import logging_setup
from thinkbatch.settings import Settings

# Each gunicorn worker logs JSON lines (LOG_FORMAT) through the root logger; gunicorn's own
# loggers are set up the same way in api/gunicorn.conf.py.
logging_setup.configure(Settings(), "api")
app = create_app()
