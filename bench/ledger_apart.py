"""What a ledger whose items keep no status in any index would cost Postgres per item, against
the ledger as it is, in one run on one Postgres.

Every claim and every store rewrites every index of `items` today (docs/performance.md,
"Postgres's share of an item"): `status` is in four of them, in a key or a partial index's
condition, so no update of an item is HOT. The other arm ("apart") keeps the same item rows
with indexes on columns that never change (the key, `(job_id, seq)`, `(job_id, custom_id)`)
and free room on each page (FILLFACTOR), so that a claim's and a store's updates can be HOT;
the work lists move out of the row:
- the pending items, in claim order, are rows of a queue table that a claim deletes (a delete
  writes no index entry);
- the running items are rows of a lease table (key, job, expiry: what the sweeper and a status
  call's running count read), inserted by the claim and deleted by the store.

Both arms run the same job (the ceiling's 20,000 items, created once by the API's parse and
COPY), the same claims of 512 in claim order with `SKIP LOCKED`, and the same fenced stores of
500 results; only the statements' tables differ. They print Postgres's CPU (every process of
the embedded Postgres, the WAL writer's and autovacuum's included) and the WAL per item for
claims and stores, rounds interleaved, the share of the item updates that were HOT, and the
ratio apart / current. The apart arm is a measurement of the design, not the product's
ledger: its fences, suspects, releases and reads are not built.

`python -m bench.ledger_apart` (the embedded PostgreSQL, or THINKBATCH_DATABASE_URL).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.ledger_alone import CLAIM_N
from bench.ledger_alone import STORE_N
from bench.ledger_alone import create
from bench.ledger_alone import done
from devstack import local_stack
from thinkbatch.ledger.claims import _CLAIM
from thinkbatch.ledger.claims import _LEASE_PICKED
from thinkbatch.ledger.items import _COMPLETE
from thinkbatch.ledger.items import results_json

# Room on each page for a new version of every row on it: a claim of 512 items updates all of
# a page's rows in one transaction, which cannot prune the versions it has just made (at 70,
# about half of the updates found no room and were not HOT).
FILLFACTOR = 45

# The apart arm's tables: the items' rows as they are (copied from the job the API stored),
# indexed only by columns no claim or store changes.
_SCHEMA = [
    "DROP TABLE IF EXISTS apart_items, apart_pending, apart_leases, apart_results",
    "CREATE TABLE apart_items (LIKE items INCLUDING DEFAULTS) WITH (fillfactor = {fillfactor})",
    "ALTER TABLE apart_items ADD PRIMARY KEY (id)",
    "CREATE UNIQUE INDEX ON apart_items (job_id, seq)",
    "CREATE UNIQUE INDEX ON apart_items (job_id, custom_id)",
    "CREATE TABLE apart_pending (job_id uuid NOT NULL, model text, prefix_key bytea,"
    " seq int NOT NULL, item_id bigint NOT NULL)",
    "CREATE INDEX ON apart_pending (job_id, model, prefix_key, seq)",
    "CREATE TABLE apart_leases (job_id uuid NOT NULL, item_id bigint NOT NULL,"
    " owner text NOT NULL, expires_at timestamptz NOT NULL, PRIMARY KEY (job_id, item_id))",
    "CREATE TABLE apart_results (LIKE item_results INCLUDING DEFAULTS)",
    "ALTER TABLE apart_results ADD PRIMARY KEY (item_id)",
    "CREATE INDEX ON apart_results (job_id)",
]

_FILL = [
    "INSERT INTO apart_items SELECT * FROM items WHERE job_id = :j ORDER BY id",
    "INSERT INTO apart_pending SELECT job_id, model, prefix_key, seq, id FROM items"
    " WHERE job_id = :j ORDER BY id",
    "ANALYZE apart_items, apart_pending",
]

# A claim: take the first pending entries in claim order (deleted: no index entry written),
# lease them, and mark the rows running (no indexed column changes: HOT where the page has room).
_APART_CLAIM = sa.text(
    """
    WITH picked AS (
        DELETE FROM apart_pending AS p USING (
            SELECT ctid FROM apart_pending
            WHERE job_id = :job_id AND model IS NULL
            ORDER BY model, prefix_key, seq LIMIT :n
            FOR UPDATE SKIP LOCKED
        ) AS s
        WHERE p.ctid = s.ctid
        RETURNING p.item_id AS id
    ), leased AS (
        INSERT INTO apart_leases (item_id, job_id, owner, expires_at)
        SELECT id, :job_id, :owner, now() + make_interval(secs => :lease_s) FROM picked
    )
    """  # noqa: S608 - the ledger's own lease of the picked rows, on the apart arm's table
    + _LEASE_PICKED.replace("UPDATE items AS i", "UPDATE apart_items AS i")
)
assert "apart_items" in _APART_CLAIM.text

# A store: the same fence and result row as the ledger's, the lease deleted.
_APART_STORE = sa.text(
    _COMPLETE.text.replace("UPDATE items AS i", "UPDATE apart_items AS i")
    .replace("INSERT INTO item_results", "INSERT INTO apart_results")
    .replace(
        "RETURNING i.id\n    )",
        "RETURNING i.id\n    ), gone AS (\n"
        "        DELETE FROM apart_leases AS l USING v, done"
        " WHERE l.job_id = v.job_id AND l.item_id = v.item_id AND done.id = v.item_id\n    )",
    )
)
assert "apart_leases" in _APART_STORE.text and "apart_results" in _APART_STORE.text

# Each arm's claim and store statements, and the table of its items.
ARMS = {
    "current": (_CLAIM["own"], _COMPLETE, "items"),
    "apart": (_APART_CLAIM, _APART_STORE, "apart_items"),
}


def make_schema(db: sa.Engine, fillfactor: int = FILLFACTOR) -> None:
    with db.begin() as conn:
        for statement in _SCHEMA:
            conn.execute(sa.text(statement.format(fillfactor=fillfactor)))


def drop_schema(db: sa.Engine) -> None:
    with db.begin() as conn:
        conn.execute(sa.text(_SCHEMA[0]))


def fill(db: sa.Engine, job_id: uuid.UUID) -> None:
    """The apart arm's copy of a job the API stored: its rows, and each in the queue."""
    with db.begin() as conn:
        for statement in _FILL:
            conn.execute(sa.text(statement), {"j": job_id})


# A backend's updates of a table not yet reported, and how many were HOT: read on each side of
# a statement, in its transaction, the difference is that statement's (the cumulative
# statistics reach pg_stat_user_tables seconds later, and before Postgres 16 this view holds
# every transaction's since the backend last reported, not only the current one's).
_HOT = sa.text(
    "SELECT coalesce(sum(n_tup_upd), 0), coalesce(sum(n_tup_hot_upd), 0)"
    " FROM pg_stat_xact_user_tables WHERE relname = :t"
)


@dataclass
class Phases:
    """What one arm's claims and stores cost: Postgres CPU (us) and WAL (bytes) per item by
    phase, and the updates of the items' table, HOT and in all."""

    per_item: dict[str, tuple[float, float]] = field(default_factory=dict)
    updates: int = 0
    hot: int = 0

    @property
    def hot_share(self) -> float:
        return self.hot / max(1, self.updates)


def run_arm(
    db: sa.Engine, job_id: uuid.UUID, arm: str, *, claim_n: int = CLAIM_N, store_n: int = STORE_N
) -> Phases:
    """Claims of every item of the job, then their stores, each in its own transaction as a
    worker commits them."""
    claim, store, table = ARMS[arm]
    claimed: list[tuple[int, uuid.UUID, int]] = []
    out = Phases()

    def lsn() -> int:
        with db.connect() as conn:
            return int(
                conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'")).scalar_one()
            )

    def counted(conn: sa.Connection, statement: sa.TextClause, params: dict[str, Any]) -> Any:
        """Run `statement`, counting its updates of the items' table."""
        before = conn.execute(_HOT, {"t": table}).one()
        rows = conn.execute(statement, params).all()
        after = conn.execute(_HOT, {"t": table}).one()
        out.updates += int(after[0] - before[0])
        out.hot += int(after[1] - before[1])
        return rows

    def phase(name: str, body: Callable[[], int]) -> None:
        wal, before = lsn(), cpu_snapshot()
        n = body()
        cpu = cpu_used(before).get("postgres", 0.0)
        out.per_item[name] = (cpu / max(1, n) * 1e6, (lsn() - wal) / max(1, n))

    def claims() -> int:
        params = {"job_id": job_id, "owner": "bench", "lease_s": 600, "n": claim_n}
        while True:
            with db.begin() as conn:
                got = counted(conn, claim, params)
            if not got:
                return len(claimed)
            claimed.extend((row.id, row.job_id, row.attempts) for row in got)

    def stores() -> int:
        for start in range(0, len(claimed), store_n):
            rows = results_json([done(*c) for c in claimed[start : start + store_n]])
            with db.begin() as conn:
                counted(conn, store, {"owner": "bench", "rows": rows})
        return len(claimed)

    phase("claims", claims)
    phase("stores", stores)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--fillfactor", type=int, default=FILLFACTOR)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-ledger-apart-"))
    env = {"THINKBATCH_MAX_ITEMS_PER_JOB": str(max(args.items, 100_000))}
    runs: dict[str, list[Phases]] = {"current": [], "apart": []}
    with local_stack(tmp, env=env, database="ledger", engine=False, demo_model=False) as local:
        db = sa.create_engine(local.database_url)
        make_schema(db, args.fillfactor)
        for r in range(args.rounds):
            for arm in ("current", "apart") if r % 2 == 0 else ("apart", "current"):
                job_id = create(db, local.settings, args.items, r)
                if arm == "apart":
                    fill(db, job_id)
                got = run_arm(db, job_id, arm)
                runs[arm].append(got)
                print(
                    f"round {r + 1} {arm:>7}: "
                    + ", ".join(
                        f"{name} postgres CPU {cpu:.1f} us/item, WAL {wal:.0f} B"
                        for name, (cpu, wal) in got.per_item.items()
                    )
                    + f"; HOT updates {got.hot_share:.0%}",
                    flush=True,
                )
        drop_schema(db)
        db.dispose()

    def median(arm: str, name: str, k: int) -> float:
        return statistics.median(run.per_item[name][k] for run in runs[arm])

    def total(run: Phases) -> float:
        return run.per_item["claims"][0] + run.per_item["stores"][0]

    print(
        f"{args.items} items, claims of {CLAIM_N}, stores of {STORE_N},"
        f" fillfactor {args.fillfactor} (apart), median of {args.rounds} rounds:"
    )
    for arm in ("current", "apart"):
        claim, store = median(arm, "claims", 0), median(arm, "stores", 0)
        print(
            f"  {arm:>7}: claim {claim:.1f} + store {store:.1f} = {claim + store:.1f} us of"
            f" Postgres CPU per item; WAL {median(arm, 'claims', 1) + median(arm, 'stores', 1):.0f}"
            f" B; HOT updates {statistics.median(run.hot_share for run in runs[arm]):.0%}"
        )
    ratios = [total(a) / total(c) for a, c in zip(runs["apart"], runs["current"], strict=True)]
    print(
        f"  apart / current, Postgres CPU per claimed and stored item: median of rounds "
        f"{statistics.median(ratios):.2f} ({' '.join(f'{x:.2f}' for x in ratios)})"
    )


if __name__ == "__main__":
    main()
