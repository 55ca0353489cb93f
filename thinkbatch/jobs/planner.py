"""The items table's planner statistics, refreshed after a large job is stored, off the
submit's path.

A job the statistics have not seen is planned as a single row (ledger.analyze_items says what
that costs a page of it). ANALYZE samples the table: about 0.2 s of Postgres after a job of
100,000 items on a 2-core host, which a submit answered only after, and its workers were hinted
only after. Here it runs on a thread of its own once the job is committed and hinted: one at a
time per process, and once more after it for any job stored meanwhile.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy.pool import NullPool

from thinkbatch import ledger
from thinkbatch.db import make_engine
from thinkbatch.settings import Settings

log = logging.getLogger(__name__)


class Refresher:
    def __init__(self, settings: Settings):
        # A connection of its own, opened and closed by each run: the thread may outlive a
        # request, a test, or the pool of the app that asked. Bounded as every connection is
        # (db.DeadPeer): a link that breaks mid-ANALYZE ends it within WORKER_DEAD_AFTER_S.
        self._engine = make_engine(settings, poolclass=NullPool)
        self._lock = threading.Lock()
        self._running = False
        self._again = False

    def request(self) -> None:
        """Refresh soon; returns at once."""
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        try:
            threading.Thread(target=self._run, name="analyze-items", daemon=True).start()
        except RuntimeError:  # no thread to be had: the job is stored, the statistics wait
            log.warning("ANALYZE items not started", exc_info=True)
            with self._lock:
                self._running = self._again = False

    def _run(self) -> None:
        while True:
            try:
                ledger.analyze_items(self._engine)
            except Exception:  # statistics are an optimisation: never a failed submit
                log.warning("ANALYZE items failed", exc_info=True)
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False
