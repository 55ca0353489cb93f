"""The ledger's statements alone, for the ceiling's job (20,000 items): one client in this process
creates the job (the API's streamed parse and COPY, without HTTP), claims every item in chunks
of the worker's claim size, and stores a result for each in the writer's batches, timing each
phase; then `EXPLAIN ANALYZE` of one claim and one store, the plans' buffer hits and triggers.

`python -m bench.ledger_alone` runs on the embedded PostgreSQL (or THINKBATCH_DATABASE_URL).
What it prints is where Postgres's share of the ceiling goes (README, Performance).
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa

from bench.cpu import cpu_snapshot
from bench.cpu import cpu_used
from bench.workload import prompts
from devstack import local_stack
from thinkbatch import ledger
from thinkbatch.jobs import JobService
from thinkbatch.keys import Caller
from thinkbatch.ledger import Claimed
from thinkbatch.ledger import Done
from thinkbatch.ledger import ModelFilter
from thinkbatch.ledger.claims import _CLAIM
from thinkbatch.ledger.items import _COMPLETE
from thinkbatch.ledger.items import results_json
from thinkbatch.settings import Settings

CLAIM_N, STORE_N = 512, 500  # the worker's claim chunk at rest and WRITE_BATCH_MAX


def create(db: sa.Engine, settings: Settings, n: int, round_no: int) -> uuid.UUID:
    body = {"items": prompts(n, round_no), "params": {"max_tokens": 16, "temperature": 0}}
    raw = io.BytesIO(json.dumps(body).encode())
    made = JobService(settings, db, celery=None).submit_stream(Caller("bench", None), raw)
    return made.job.id


def done(item_id: int, job_id: uuid.UUID, attempt: int) -> Done:
    return Done(item_id, job_id, attempt, "", "x" * 16, "length", False, 20, 16, 0)


def timed_round(db: sa.Engine, settings: Settings, n: int, round_no: int) -> str:
    # Postgres's CPU per phase beside the wall time: on a host shared with other work the wall
    # time measures the neighbours too, the CPU seconds of this Postgres much less so.
    walls: dict[str, float] = {}
    postgres: dict[str, float] = {}
    claimed: list[Claimed] = []
    job_id = uuid.uuid4()

    wal: dict[str, float] = {}

    def lsn() -> int:
        with db.connect() as conn:
            return int(
                conn.execute(sa.text("SELECT pg_current_wal_insert_lsn() - '0/0'")).scalar_one()
            )

    def phase(name: str, run: Callable[[], None]) -> None:
        # The WAL written during each phase, beside its times: bytes move far less than times
        # with the host's load, so a change to the schema or the statements shows in them. It is
        # the cluster's: on a shared Postgres, others' writes and a checkpoint's page images too.
        wal_before = lsn()
        before, started = cpu_snapshot(), time.perf_counter()
        run()
        walls[name] = time.perf_counter() - started
        postgres[name] = cpu_used(before).get("postgres", 0.0)
        wal[name] = lsn() - wal_before

    def do_create() -> None:
        nonlocal job_id
        job_id = create(db, settings, n, round_no)

    def do_claims() -> None:
        with db.connect() as conn:  # as a worker serving the job's model holds it
            row = ledger.job_to_drive(conn, job_id)
        assert row is not None
        models = ModelFilter.of(row.model, row.models or [row.model], [row.model])
        while True:
            with db.begin() as conn:
                got = ledger.claim(
                    conn, job_id, owner="bench", n=CLAIM_N, lease_s=600, models=models
                )
            if not got:
                return
            claimed.extend(got)

    def do_stores() -> None:
        for start in range(0, len(claimed), STORE_N):
            with db.begin() as conn:
                batch = claimed[start : start + STORE_N]
                ledger.complete(conn, "bench", [done(c.id, c.job_id, c.attempt) for c in batch])
                ledger.finalize_jobs(conn, {job_id})

    phase("create", do_create)
    phase("claims", do_claims)
    phase("stores", do_stores)
    return ", ".join(
        f"{k} {v:.2f} s ({v / n * 1e6:.0f} us/item, postgres CPU {postgres[k] / n * 1e6:.0f},"
        f" WAL {wal[k] / n:.0f} B)"
        for k, v in walls.items()
    )


def plans(db: sa.Engine, settings: Settings) -> None:
    """One claim and one store of a fresh job, each committed apart as the worker does."""
    job_id = create(db, settings, CLAIM_N * 2, 99)
    explain = "EXPLAIN (ANALYZE, BUFFERS) "
    with db.begin() as conn:
        lines = conn.execute(
            sa.text(explain + _CLAIM["own"].text),
            {"job_id": job_id, "owner": "bench", "n": CLAIM_N, "lease_s": 600},
        ).scalars()
        print(f"-- one claim of {CLAIM_N} items --")
        print("\n".join(lines))
    with db.connect() as conn:
        running = conn.execute(
            sa.text(
                "SELECT id, job_id, attempts FROM items"
                " WHERE job_id = :j AND status = 'running' LIMIT :n"
            ),
            {"j": job_id, "n": STORE_N},
        )
        rows = results_json([done(*row) for row in running])
    with db.begin() as conn:
        lines = conn.execute(
            sa.text(explain + _COMPLETE.text), {"owner": "bench", "rows": rows}
        ).scalars()
        print(f"-- one store of {STORE_N} results --")
        print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="thinkbatch-ledger-"))
    env = {"THINKBATCH_MAX_ITEMS_PER_JOB": str(max(args.items, 100_000))}
    with local_stack(tmp, env=env, database="ledger", engine=False, demo_model=False) as local:
        db = sa.create_engine(local.database_url)
        for r in range(args.rounds):
            phases = timed_round(db, local.settings, args.items, r)
            print(f"round {r + 1}, {args.items} items: {phases}")
        plans(db, local.settings)
        db.dispose()


if __name__ == "__main__":
    main()
