"""Claiming: leasing pending items of a runnable job to a worker, either in seq order or, for
the items that were in flight when an engine died, one group of suspects at a time."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import lock_jobs
from thinkbatch.ledger.rows import Claimed
from thinkbatch.ledger.statuses import RUNNABLE
from thinkbatch.models import JobStatus

# A job's pending items not crashed (the claims' and ix_items_pending's), and its crash suspects
# (ix_items_pending_suspects').
FRESH = "status = 'pending' AND crashes = 0"
SUSPECT = "status = 'pending' AND crashes > 0"

# Lease the picked items to :owner and count the attempt; shared by both claims below.
_LEASE_PICKED = """
    UPDATE items AS i SET
        status = 'running', attempts = i.attempts + 1, lease_owner = :owner,
        lease_expires_at = now() + make_interval(secs => :lease_s),
        started_at = coalesce(i.started_at, now())
    FROM picked WHERE i.id = picked.id
    RETURNING i.id, i.job_id, i.seq, i.custom_id, i.messages, i.prompt, i.params,
              i.attempts, i.crashes, i.model, i.prefix_key
"""

# Which of a job's items a worker may take, by model. An item's model is NULL when it is the
# job's own (`jobs.model`): a job of one model writes no model per item. The suspects' claims
# and probes below filter the few suspects by these; a claim of the rest goes by name (_CLAIM).
_BY_MODEL = {
    "all": "",
    "named_one": " AND model = :model",
    "named": " AND model = ANY(:models)",
    "named_or_job": " AND (model IS NULL OR model = ANY(:models))",
}

# A claim takes a job's pending items by served name (ModelFilter.served, _claim_by_name): the
# job's own items (a NULL model) and each other name the worker serves. Each name is one range
# of ix_items_pending (job_id, model, prefix_key, seq), walked in claim order: by prefix key
# (thinkbatch/jobs/prefix.py, NULL last), so that items whose prompts begin alike run together,
# then in submission order. A claim reads the items it takes and no others, whatever else the
# job holds: one filter over all of a job's pending items (`model IS NULL OR model = ANY(...)`)
# reads past every item of the names a worker does not serve, and `= ANY` alone sorts all of
# its own. `ORDER BY model` first: the range of one model is then the index's own order (a NULL
# model is a range too, but `IS NULL` does not let the planner drop the column from the order).
_CLAIM_ARMS = {"own": "model IS NULL", "named": "model = :model"}


def _claim_sql(arm: str) -> sa.TextClause:
    return sa.text(
        f"""
        WITH picked AS (
            SELECT id FROM items
            WHERE job_id = :job_id AND {FRESH} AND {_CLAIM_ARMS[arm]}
            ORDER BY model, prefix_key, seq LIMIT :n
            FOR UPDATE SKIP LOCKED
        )
        """  # noqa: S608 - constants of this module
        + _LEASE_PICKED
    )


_CLAIM = {arm: _claim_sql(arm) for arm in _CLAIM_ARMS}


# Items that were in flight when an engine or a worker died are suspects. They run apart from
# everything else, the most-crashed tier in two halves, so a poison item is cornered in a few
# engine deaths and its batch-mates are not charged for it (see `release_crashed`). A tier's
# size counts its members that already finished, so the second half runs whole instead of
# being halved again.
def _suspects_sql(models: str) -> sa.TextClause:
    by_model = _BY_MODEL[models]
    return sa.text(
        f"""
        WITH top AS (
            SELECT max(crashes) AS crashes FROM items
            WHERE job_id = :job_id AND {SUSPECT}{by_model}
        ), tier AS (
            SELECT count(*) AS n FROM items
            WHERE job_id = :job_id AND crashes = (SELECT crashes FROM top){by_model}
        ), picked AS (
            SELECT id FROM items
            WHERE job_id = :job_id AND status = 'pending'
              AND crashes = (SELECT crashes FROM top){by_model}
            ORDER BY seq
            LIMIT (SELECT greatest(1, ceil(n / 2.0))::int FROM tier)
            FOR UPDATE SKIP LOCKED
        )
        """  # noqa: S608 - constants of this module
        + _LEASE_PICKED
    )


_CLAIM_SUSPECTS = {kind: _suspects_sql(kind) for kind in _BY_MODEL}


def claim(
    conn: sa.Connection,
    job_id: uuid.UUID,
    *,
    owner: str,
    n: int,
    lease_s: float,
    suspects: bool = False,
    models: ModelFilter | None = None,
    turn: int = 0,
) -> list[Claimed]:
    """Lease up to `n` pending items of a runnable job (or one group of suspects) to `owner`:
    of every model, or only of those `models` lets through. `turn` picks the served name whose
    share comes first; a claimer turns it from claim to claim, since a claim smaller than its
    names would otherwise always go to the first of them."""
    # Suspects are claimed one group at a time (the halving in _CLAIM_SUSPECTS counts what
    # the others took): their claims exclude each other, as stores of the job do.
    state = lock_jobs(conn, [job_id], Lock.items if suspects else Lock.work).get(job_id)
    if state is None or state.status not in RUNNABLE or state.expired:
        return []
    if n <= 0 and not suspects:
        return []
    params: dict[str, Any] = {"job_id": job_id, "owner": owner, "lease_s": lease_s}
    rows: list[Any]
    if suspects:
        kind = "all" if models is None else models.kind
        got = conn.execute(_CLAIM_SUSPECTS[kind], params | _model_params(models)).all()
        rows = sorted(got, key=_claim_order)
    else:
        # No filter: every model of the job, which only a claim by name needs spelled out.
        served = (models or _every_model(conn, job_id)).served()
        first = turn % len(served) if served else 0
        rows = _claim_by_name(conn, served[first:] + served[:first], params, n)
    if rows and state.status == JobStatus.queued:
        conn.execute(
            sa.text(
                "UPDATE jobs SET status = 'running', started_at = coalesce(started_at, now()) "
                "WHERE id = :id AND status = 'queued'"
            ),
            {"id": job_id},
        )
    return [Claimed(*row[:-1]) for row in rows]


def _claim_by_name(
    conn: sa.Connection, served: list[list[str | None]], params: dict[str, Any], n: int
) -> list[Any]:
    """Up to `n` pending items, shared evenly between the served names that have some: each
    name's share, then what a name lacked taken from the others. A worker takes some of each
    of its names at every claim, as the workers that serve only one of them do: one that took
    its names in turn would leave the items only it serves until the shared ones are done."""
    rows: list[Any] = []
    while served and len(rows) < n:
        share = -(-(n - len(rows)) // len(served))  # rounded up: the shares fill `n`
        more = []
        for arms in served:
            want = min(share, n - len(rows))
            if want <= 0:
                break
            got: list[Any] = []
            for name in arms:
                wanted = params | {"n": want - len(got)}
                if name is not None:
                    wanted["model"] = name
                got += sorted(
                    conn.execute(_CLAIM["own" if name is None else "named"], wanted).all(),
                    key=_claim_order,
                )
                if len(got) >= want:
                    break
            rows += got
            if len(got) >= want:
                more.append(arms)  # it may have more: asked again for what others lacked
        served = more
    return rows


def _claim_order(row: Any) -> tuple[bool, bytes, int]:
    """In claim order (UPDATE ... RETURNING keeps none): the engine is handed a chunk in this
    order, so the items of one prefix stay next to each other inside it too."""
    return (row.prefix_key is None, row.prefix_key or b"", row.seq)


def _every_model(conn: sa.Connection, job_id: uuid.UUID) -> ModelFilter:
    """The filter of a worker that serves every model of the job."""
    job_model, job_models = conn.execute(
        sa.text("SELECT model, models FROM jobs WHERE id = :id"), {"id": job_id}
    ).one()
    names = job_models or [job_model]
    return ModelFilter.of(job_model, names, names)


@dataclass(frozen=True, slots=True)
class ModelFilter:
    """The items of a job a worker may claim: those of `names` (the job's models it serves),
    and the job's own (NULL) ones when `job_model` is among them."""

    names: tuple[str, ...]
    job_model: str
    every: bool = False  # it serves all of the job's models: no filter

    @classmethod
    def of(cls, job_model: str, job_models: list[str], served: list[str]) -> ModelFilter:
        mine = tuple(m for m in job_models if m in served)
        return cls(mine, job_model, every=len(mine) == len(set(job_models)))

    def served(self) -> list[list[str | None]]:
        """The served names a claim shares itself between, each as the arms of _CLAIM that
        hold its items: the job's model as its own items (a NULL model) and then those naming
        it (a batch file's lines name theirs); every other name as itself."""
        return [[None, name] if name == self.job_model else [name] for name in self.names]

    @property
    def kind(self) -> str:
        if self.every:
            return "all"
        if self.job_model in self.names:
            return "named_or_job"
        return "named_one" if len(self.names) == 1 else "named"


def _model_params(models: ModelFilter | None) -> dict[str, Any]:
    """The parameters of the `_BY_MODEL` condition of `models`."""
    kind = "all" if models is None else models.kind
    if models is None or kind == "all":
        return {}
    if kind == "named_one":
        return {"model": models.names[0]}
    return {"models": list(models.names)}


# The probes for pending work below answer each arm from the index meant for it: a job's
# pending items not crashed from ix_items_pending, one range per name (the job's own items, a
# NULL model, are a range too); its suspects from ix_items_pending_suspects; any pending item at
# all (no model filter) from the first entry of the job's pending range of
# ix_items_job_id_status_seq. One condition over a job's pending items with a model filter is
# answered from that last index, reading every pending item's row to filter it: the whole
# remaining work of the job, for a worker none of it is for, once a second. Each arm asks for
# the first item in its index's order, not for any matching row: for the latter a prepared
# statement's generic plan, which knows neither the job nor the model, takes a sequential scan
# (expecting a match at once) and reads the whole table.
def any_item(job: str, where: str, order: str) -> str:
    """Whether an item of the job `job` (an expression) meets `where`: the first in `order`,
    the order of the index meant to answer it."""
    return (
        f"(SELECT 1 FROM items WHERE items.job_id = {job} AND {where}"  # noqa: S608 - constants
        f" ORDER BY {order} LIMIT 1) IS NOT NULL"
    )


def any_named(job: str, names: str) -> str:
    """Whether a pending item of the job `job`, not crashed, has a model among `names` (a
    text[] expression): an ordered look into ix_items_pending for each name.
    `model = ANY(...)` in one scan is matched against each of the job's entries in Postgres
    before 17, which cannot keep such a scan in index order."""
    return (
        f"EXISTS (SELECT 1 FROM unnest(CAST({names} AS text[])) AS n(name), LATERAL ("  # noqa: S608 - constants
        f"SELECT 1 FROM items WHERE items.job_id = {job} AND {FRESH}"
        " AND items.model = n.name ORDER BY model, prefix_key, seq LIMIT 1) AS first)"
    )


def _arm(where: str, order: str) -> str:
    return any_item(":id", where, order)


_SUSPECTS_ORDER = "crashes, seq"
_HAS_SUSPECTS = {
    kind: sa.text("SELECT " + _arm(SUSPECT + by_model, _SUSPECTS_ORDER))
    for kind, by_model in _BY_MODEL.items()
}
_HAS_PENDING = {
    "all": sa.text("SELECT " + _arm("status = 'pending'", "status, seq")),
    "named_one": sa.text(
        f"SELECT {_arm(FRESH + ' AND model = :model', 'model, prefix_key, seq')}"
        f" OR {_arm(SUSPECT + ' AND model = :model', _SUSPECTS_ORDER)}"
    ),
    "named": sa.text(
        f"SELECT {any_named(':id', ':models')}"
        f" OR {_arm(SUSPECT + ' AND model = ANY(:models)', _SUSPECTS_ORDER)}"
    ),
    "named_or_job": sa.text(
        f"SELECT {any_named(':id', ':models')}"
        f" OR {_arm(FRESH + ' AND model IS NULL', 'model, prefix_key, seq')}"
        f" OR {_arm(SUSPECT + ' AND (model IS NULL OR model = ANY(:models))', _SUSPECTS_ORDER)}"
    ),
}


def has_pending(conn: sa.Connection, job_id: uuid.UUID, models: ModelFilter | None = None) -> bool:
    """Whether the job has pending items (suspects too) of the models in `models`."""
    return _probe(conn, _HAS_PENDING, job_id, models)


def has_suspects(conn: sa.Connection, job_id: uuid.UUID, models: ModelFilter | None = None) -> bool:
    """Whether the job has pending crash suspects of the models in `models`."""
    return _probe(conn, _HAS_SUSPECTS, job_id, models)


def _probe(
    conn: sa.Connection,
    statements: dict[str, sa.TextClause],
    job_id: uuid.UUID,
    models: ModelFilter | None,
) -> bool:
    kind = "all" if models is None else models.kind
    params: dict[str, Any] = {"id": job_id, **_model_params(models)}
    return bool(conn.execute(statements[kind], params).scalar())
