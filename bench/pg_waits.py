"""What the benchmark database's backends wait on while Postgres works, sampled.

Thread CPU clocks tell where CPU goes; they do not show a transaction waiting for another's row
lock, which takes no CPU and still holds the pipeline up. This samples `pg_stat_activity` every
few milliseconds on a connection of its own and counts, over the samples in which at least one
backend of the database runs a statement, how often one of them waits on a lock, on the WAL, or
is running. `make bench` prints it for the ceiling (bench/throughput.py).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from dataclasses import field

import sqlalchemy as sa

INTERVAL_S = 0.005

_ACTIVITY = sa.text(
    """
    SELECT wait_event_type, wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 60),
           CASE WHEN length(query) > 100 THEN right(regexp_replace(query, '\\s+', ' ', 'g'), 40) END
    FROM pg_stat_activity
    WHERE datname = current_database() AND pid <> pg_backend_pid() AND state = 'active'
    """
)


def kind(wait_type: str | None, wait: str | None) -> str:
    if wait_type == "Lock":
        return f"waiting on a lock ({wait})"
    if wait_type in ("IO", "LWLock") and wait and wait.startswith("Wal"):
        return "writing the WAL"
    if wait_type is None:
        return "running"
    return f"{wait_type}:{wait}"


@dataclass
class Waits:
    samples: int = 0  # samples with at least one backend running a statement
    kinds: Counter[str] = field(default_factory=Counter)  # samples with a backend in that state
    locked: Counter[str] = field(default_factory=Counter)  # the statements that waited on locks
    lock_samples: int = 0  # samples with at least one backend waiting on a lock
    # Backend-samples waiting on a lock, by the lock's kind and the statement (its first 60
    # characters and, of a long one, its last 40: where a FOR ... clause is).
    lock_waits: Counter[tuple[str, str]] = field(default_factory=Counter)

    def share(self, what: str) -> float:
        return self.kinds[what] / self.samples if self.samples else 0.0

    def summary(self) -> str:
        if not self.samples:
            return "no sample with a statement running"
        shown = ", ".join(f"{k} {100 * v / self.samples:.0f}%" for k, v in self.kinds.most_common())
        return f"{self.samples} samples; a backend was {shown}"


class PgWaits:
    """Samples while a `with` block runs."""

    def __init__(self, database_url: str) -> None:
        self.engine = sa.create_engine(database_url, pool_size=1)
        self.waits = Waits()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-waits", daemon=True)
        self.backend_pid: int | None = None  # the sampler's own backend, once connected

    def __enter__(self) -> Waits:
        self._thread.start()
        return self.waits

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.engine.dispose()

    def _run(self) -> None:
        with self.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            self.backend_pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            while not self._stop.wait(INTERVAL_S):
                rows = conn.execute(_ACTIVITY).all()
                if not rows:
                    continue
                self.waits.samples += 1
                for k in {kind(t, w) for t, w, _q, _e in rows}:
                    self.waits.kinds[k] += 1
                if any(t == "Lock" for t, _w, _q, _e in rows):
                    self.waits.lock_samples += 1
                for t, w, query, end in rows:
                    if t == "Lock":
                        self.waits.locked[query.strip()[:40]] += 1
                        text = query.strip() + (f" ... {end.strip()}" if end else "")
                        self.waits.lock_waits[w, text] += 1
