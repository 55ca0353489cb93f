"""The job service's front door: submit, read, list, page, stream and cancel jobs. The REST API,
the OpenAI facade (thinkbatch/openai), the dashboard and the tools all go through it.

A submission is stored in one transaction (the job row, every item by COPY, the job's settings)
and any invalid item stores nothing (but an OpenAI batch's line refused for its request body,
which is stored failed: create.RefusedItem); once it commits, a hint goes to Redis and is
recorded. A job with nothing left to run (every line refused) is finished in that transaction
and never hinted.
Every submission may carry an idempotency key: the same key with the same request answers the
job it made (a client retrying after a lost response gets that job, never a second one), and
with another request is a 400. A submission's writes go through the ledger, like every write.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from datetime import timedelta
from typing import IO
from typing import Any

import sqlalchemy as sa
from celery import Celery
from sqlalchemy import orm

from thinkbatch import ledger
from thinkbatch.db import make_sessionmaker
from thinkbatch.db import reads as db_reads
from thinkbatch.errors import Conflict
from thinkbatch.errors import InputError
from thinkbatch.errors import NotFound
from thinkbatch.guard import Limits
from thinkbatch.guard import read_body
from thinkbatch.jobs import create
from thinkbatch.jobs import quotas
from thinkbatch.jobs import read
from thinkbatch.jobs import results
from thinkbatch.jobs import stats
from thinkbatch.jobs.context import for_model
from thinkbatch.jobs.create import RefusedItem
from thinkbatch.jobs.fleet import Fleet
from thinkbatch.jobs.fleet import LiveWorkers
from thinkbatch.jobs.fleet import ModelLoad
from thinkbatch.jobs.fleet import live_workers
from thinkbatch.jobs.fleet import parents as fleet_parents
from thinkbatch.jobs.fleet import work_by_model
from thinkbatch.jobs.planner import Refresher
from thinkbatch.jobs.wire import ItemIn
from thinkbatch.jobs.wire import ItemPage
from thinkbatch.jobs.wire import JobHeader
from thinkbatch.jobs.wire import JobOut
from thinkbatch.jobs.wire import JobPage
from thinkbatch.keys import Caller
from thinkbatch.ledger.submits import NewJob
from thinkbatch.models import ItemStatus
from thinkbatch.models import Job
from thinkbatch.models import JobStatus
from thinkbatch.queue import model_queue
from thinkbatch.queue import publish_job
from thinkbatch.settings import Settings

_DIGEST_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool  # the job an earlier request with the same idempotency key made


@dataclass(frozen=True)
class Origin:
    """Where a batch of the OpenAI API came from (stored on its job, shown by that API)."""

    endpoint: str
    input_file_id: uuid.UUID
    completion_window_text: str
    output_expires_after_s: int | None = None


# Told an item's error (its index, the item, the error): a RefusedItem to store in its place, or
# None to leave it out (the caller then refuses the submission as a whole).
ItemErrors = Callable[[int, ItemIn | RefusedItem, InputError], RefusedItem | None]


def digest_of(*parts: bytes) -> bytes:
    return hashlib.sha256(b"\0".join(parts)).digest()


class JobService:
    """`celery` None: jobs are stored without a hint (an in-process caller such as a benchmark
    that drives workers itself); the sweeper hints them once they go stale."""

    def __init__(self, settings: Settings, engine: sa.Engine, celery: Celery | None):
        self.settings = settings
        self.engine = engine
        self.celery = celery
        self.sessions = make_sessionmaker(engine)
        self.planner = Refresher(settings)
        # The same pool, each statement its own transaction: a poll's reads then cost no BEGIN
        # and no ROLLBACK round trip, only their own, and no read ends in a rollback, which
        # would drop the connection's prepared statements (thinkbatch.db.reads). Every read
        # below goes through it, as connections or as sessions.
        self.reads = db_reads(engine)
        self.read_sessions = make_sessionmaker(self.reads)
        # Who serves which model, for polls: at most half a heartbeat old, and never older than
        # a second (fleet.LiveWorkers).
        self.live = LiveWorkers(
            settings.worker_dead_after_s, ttl_s=min(1.0, settings.heartbeat_s / 2)
        )

    # --- submit ------------------------------------------------------------------------------

    def submit_stream(
        self, caller: Caller, body: IO[bytes], *, idempotency_key: str | None = None
    ) -> Submitted:
        """A job from a JSON request body, validated as it streams (thinkbatch/guard.py): the
        items are copied as they are read, and the job's fields may come after them. The body
        must be seekable when an idempotency key is given (its digest is read first)."""
        digest = None
        if idempotency_key is not None:
            hashed = hashlib.sha256()
            while chunk := body.read(_DIGEST_CHUNK):
                hashed.update(chunk)
            body.seek(0)
            digest = hashed.digest()

        def fill(conn: sa.Connection, rows: create.ItemRows) -> JobHeader:
            fields: dict[str, object] = {}
            saw_items = False

            def stream() -> Iterator[tuple[object, ...]]:
                nonlocal saw_items
                for kind, value in read_body(body, Limits.of(self.settings)):
                    if kind == "field":
                        key, raw = value
                        fields[key] = raw
                    elif kind == "items":
                        saw_items = True
                        model = fields.get("model")
                        if isinstance(model, str):  # named before the items: check them by it
                            rows.use_model(model)
                    else:
                        yield rows.row(rows.count, create.parse_item(rows.count, value))

            try:
                ledger.copy_items(conn, stream())
                if not saw_items:
                    create.parse_header(fields)  # a bad header field is the better message
                    raise InputError("items: Field required", param="items", code="missing")
                if rows.count == 0:
                    raise InputError(
                        "items: List should have at least 1 item after validation, not 0",
                        param="items",
                        code="too_short",
                    )
                return create.parse_header(fields)
            except InputError as error:
                raise create.out_of_range(error, self.settings) from None

        return self._store(caller, fill, key=idempotency_key, digest=digest)

    def submit(
        self,
        caller: Caller,
        items: Iterable[ItemIn | RefusedItem],
        header: JobHeader,
        *,
        origin: Origin | None = None,
        idempotency_key: str | None = None,
        digest: bytes | None = None,
        item_errors: ItemErrors | None = None,
        refused: Callable[[], bool] | None = None,
    ) -> Submitted:
        """A job of `items` (read inside the storing transaction: an iterator is consumed as
        the items are copied). The header is known first, so each item is checked against it
        as it comes. With `item_errors`, an item that fails its checks is reported there (with
        its index among `items`), which says whether to store it refused or to leave it out;
        a RefusedItem among `items` is stored failed as it is. Once `refused()` says the
        submission will be refused as a whole (the caller's iterator then raises when it
        ends), the items are still checked but no longer written."""
        create.check_header(header, self.settings)

        def one(
            rows: create.ItemRows, index: int, item: ItemIn | RefusedItem
        ) -> tuple[object, ...] | None:
            try:
                if isinstance(item, RefusedItem):
                    return rows.refused(index, item)
                return rows.row(index, item)
            except InputError as error:
                if item_errors is None:
                    raise
                instead = item_errors(index, item, error)
            if instead is None or isinstance(item, RefusedItem):
                return None
            try:
                return rows.refused(index, instead)
            except InputError as error:  # its place or its custom_id: the file's own fault
                item_errors(index, instead, error)
                return None

        def fill(conn: sa.Connection, rows: create.ItemRows) -> JobHeader:
            def stream() -> Iterator[tuple[object, ...]]:
                for index, item in enumerate(items):
                    row = one(rows, index, item)
                    if row is not None and (refused is None or not refused()):
                        yield row

            ledger.copy_items(conn, stream())
            return header

        return self._store(
            caller, fill, key=idempotency_key, digest=digest, origin=origin, header=header
        )

    def record_refused(
        self,
        caller: Caller,
        header: JobHeader,
        errors: list[dict[str, Any]],
        *,
        origin: Origin,
        idempotency_key: str | None = None,
        digest: bytes | None = None,
    ) -> Submitted:
        """A submission refused for what its input holds (a batch file with bad lines), stored
        `failed` with the errors and no item, so that it can be shown and retried by key."""
        with self.sessions() as session, session.begin():
            conn = session.connection()
            now = ledger.lock_tenant(conn, caller.tenant)
            found = self._replay(session, caller, idempotency_key, digest)
            if found is not None:
                return found
            job = self._new_job(caller, idempotency_key, digest, origin, header, now)
            ledger.insert_refused_job(conn, job, errors=errors, metadata=header.metadata)
        return Submitted(self._load(job.id), replayed=False)

    def _store(
        self,
        caller: Caller,
        fill: Callable[[sa.Connection, create.ItemRows], JobHeader],
        *,
        key: str | None,
        digest: bytes | None,
        origin: Origin | None = None,
        header: JobHeader | None = None,
    ) -> Submitted:
        """`header`: the job's, when known before its items (see create.ItemRows)."""
        settings = self.settings
        with self.sessions() as session, session.begin():
            conn = session.connection()
            # The tenant's submissions are serialized from here to the commit, so that its
            # quotas and keys hold under parallel submits; the cheap checks come first.
            now = ledger.lock_tenant(conn, caller.tenant)
            found = self._replay(session, caller, key, digest)
            if found is not None:
                return found
            quotas.check_submission_rate(conn, caller.tenant, settings)
            quotas.check_unfinished_items(conn, caller.tenant, 1, settings)
            job = self._new_job(caller, key, digest, origin, None, now)
            ledger.insert_job(conn, job)
            fleet = Fleet.read(conn, settings)
            # Every name's context bound, read before the items stream: the connection is busy
            # with their COPY from then on.
            bounds = {
                name: for_model(conn, name, dead_after_s=settings.worker_dead_after_s)
                for name in fleet.names()
            }
            known = header.model if header is not None and header.model else job.model
            rows = create.ItemRows(
                job.id,
                settings,
                bounds.get(known),
                header.params if header is not None else None,
                fleet=fleet,
                bounds=bounds,
                # A streamed body's model may come after its items (ItemRows.use_model).
                default_model=job.model if header is None else None,
                stored_at=job.created_at,
            )
            header = fill(conn, rows)
            create.check_header(header, settings, fleet)
            rows.finish(header)
            # Refused items never run: the quota counts the ones that will.
            _, runnable = ledger.stored_items(conn, job.id)
            quotas.check_unfinished_items(conn, caller.tenant, runnable, settings, exclude=job.id)
            window = header.completion_window or settings.default_completion_window_s
            job_model = rows.job_model(header)
            ledger.settle_job(
                conn,
                job.id,
                model=job_model,
                models=rows.models(job_model),
                params=header.params.overrides(),
                metadata=header.metadata,
                priority=header.priority,
                expires_at=job.created_at + timedelta(seconds=window),
            )
            if runnable == 0:  # every item refused: nothing for a worker, it ends now
                ledger.finalize_jobs(conn, [job.id])
            # The job as this commit stores it: read after the commit, a worker woken by the
            # hint (or polling) may already have claimed it, and the answer would depend on
            # the race.
            stored = self._load(job.id, session)
        if runnable > 0:
            by_model = dict(rows.by_model)
            if rows.job_model_items:
                by_model[job_model] = by_model.get(job_model, 0) + rows.job_model_items
            self._hint(job.id, by_model)
        if 0 < settings.analyze_after_items <= rows.count:
            self.planner.request()
        return Submitted(stored, replayed=False)

    def _new_job(
        self,
        caller: Caller,
        key: str | None,
        digest: bytes | None,
        origin: Origin | None,
        header: JobHeader | None,
        now: datetime,
    ) -> NewJob:
        window = (header.completion_window if header else None) or (
            self.settings.default_completion_window_s
        )
        return NewJob(
            id=uuid.uuid4(),
            tenant=caller.tenant,
            model=self.settings.model_name,
            created_at=now,
            expires_at=now + timedelta(seconds=window),
            idempotency_key=key,
            request_digest=digest,
            endpoint=origin.endpoint if origin else None,
            input_file_id=origin.input_file_id if origin else None,
            completion_window_text=origin.completion_window_text if origin else None,
            output_expires_after_s=origin.output_expires_after_s if origin else None,
        )

    def _replay(
        self, session: orm.Session, caller: Caller, key: str | None, digest: bytes | None
    ) -> Submitted | None:
        """The job this key already made: this request again, or a 400 for another one."""
        if key is None:
            return None
        found = ledger.find_by_key(session.connection(), caller.tenant, key)
        if found is None:
            return None
        job_id, made_from = found
        if made_from is not None and made_from != digest:
            raise InputError(
                "Idempotency-Key: already used for a different request",
                param="Idempotency-Key",
                code="idempotency_key_reused",
            )
        return Submitted(self._load(job_id, session), replayed=True)

    def _hint(self, job_id: uuid.UUID, by_model: dict[str, int]) -> None:
        """After the commit, so that a worker finds the rows: on the queue of each of the job's
        models, as many hints as its share of the items calls for. If Redis is down the job
        still stands: the sweeper enqueues it once Redis is back."""
        if self.celery is None:
            return
        sent = all(
            publish_job(
                self.celery,
                job_id,
                copies=create.fanout(items, self.settings),
                queue=model_queue(self.settings, model),
            )
            for model, items in sorted(by_model.items())
        )
        if sent:
            with self.engine.begin() as conn:
                ledger.mark_hinted(conn, job_id)

    def _load(self, job_id: uuid.UUID, session: orm.Session | None = None) -> Job:
        if session is not None:
            job = session.get(Job, job_id, populate_existing=True)
            assert job is not None
            return job
        with self.read_sessions() as fresh:
            job = fresh.get(Job, job_id)
            assert job is not None
            return job

    def waiting_for(self, job: Job) -> list[str]:
        """The models the job's pending items wait for (read.waiting_for)."""
        with self.reads.connect() as conn:
            live = live_workers(conn, dead_after_s=self.settings.worker_dead_after_s)
            return read.waiting_for(conn, job, live)

    def models_view(self) -> list[ModelLoad]:
        """Every served name with its live workers and the fleet's pending and running items
        on it (the dashboard's table of models; all tenants' work, counts only)."""
        with self.reads.connect() as conn:
            fleet = Fleet.read(conn, self.settings)
            work = work_by_model(conn)
        names = fleet.names() + sorted({m for m, _ in work} - set(fleet.names()))
        parents = fleet_parents(self.settings, fleet)
        return [
            ModelLoad(
                model=name,
                parent=parents.get(name),
                workers=fleet.live.get(name, 0),
                pending=work.get((name, "pending"), 0),
                running=work.get((name, "running"), 0),
            )
            for name in names
        ]

    def fleet(self) -> Fleet:
        """What the fleet is configured for and serves now (thinkbatch/jobs/fleet.py)."""
        with self.reads.connect() as conn:
            return Fleet.read(conn, self.settings)

    # --- read ----------------------------------------------------------------------------------

    def get(self, caller: Caller, job_id: uuid.UUID) -> Job:
        with self.read_sessions() as session:
            job = read.get_job(session, caller, job_id)
        if self._expired_on_read(job.id, job.status, job.expires_at):
            return self._load(job_id)
        return job

    def _expired_on_read(self, job_id: uuid.UUID, status: str, expires_at: datetime) -> bool:
        """Expire a job the read finds past its window, as the sweeper would, and say whether
        it did. The sweeper runs in workers: a job of a model whose worker set is scaled to
        zero (the autoscaler counts no lapsed job's pending items) or that no worker serves
        would otherwise stay queued past its window for as long as no worker starts."""
        if status not in ledger.RUNNABLE or expires_at > datetime.now(expires_at.tzinfo):
            return False
        with self.engine.begin() as conn:  # the ledger decides by the database's clock
            return ledger.expire_job(conn, job_id) > 0

    def status(
        self, caller: Caller, job_id: uuid.UUID, conn: sa.Connection | None = None
    ) -> JobOut:
        """The job with its thinking statistics (stats.py). `conn`: a connection of `reads`
        the caller already holds (the API's request connection), else one is taken."""
        if conn is None:
            with self.reads.connect() as own:
                return self.status(caller, job_id, own)
        # Statements built once: this is what pollers call, many times a second. The live
        # workers matter only while the job has items waiting for them.
        job = read.job_record(conn, caller, job_id)
        if self._expired_on_read(job.id, job.status, job.expires_at):
            job = read.job_record(conn, caller, job_id)
        waiting: list[str] = []
        if job.pending > 0:
            live = self.live.get(conn)
            waiting = read.waiting_for(conn, job, live)
        return read.job_out(job, stats.job_stats(conn, job), waiting)

    def list_jobs(
        self,
        caller: Caller,
        *,
        after: uuid.UUID | None,
        limit: int,
        batches_only: bool = False,
    ) -> tuple[list[Job], bool]:
        with self.read_sessions() as session:
            return read.list_jobs(
                session, caller, after=after, limit=limit, batches_only=batches_only
            )

    def page(self, caller: Caller, *, after: uuid.UUID | None, limit: int) -> JobPage:
        jobs, more = self.list_jobs(caller, after=after, limit=limit)
        with self.reads.connect() as conn:
            live = self.live.get(conn)
            waiting = [read.waiting_for(conn, job, live) for job in jobs]
        return read.job_page(jobs, more, waiting)

    def items(
        self,
        caller: Caller,
        job_id: uuid.UUID,
        *,
        status: ItemStatus | None = None,
        after: str | None = None,
        limit: int = 100,
        include_thinking: bool = True,
        conn: sa.Connection | None = None,
    ) -> ItemPage:
        """`conn`: a connection of `reads` the caller already holds (as for `status`)."""
        with self.reads.connect() if conn is None else contextlib.nullcontext(conn) as reads:
            return read.items_page(
                reads,
                caller,
                job_id,
                status=status,
                after=after,
                limit=limit,
                include_thinking=include_thinking,
            )

    def results(
        self,
        caller: Caller,
        job_id: uuid.UUID,
        *,
        status: ItemStatus | None = None,
        include_thinking: bool = True,
        conn: sa.Connection | None = None,
    ) -> Iterator[bytes]:
        """Every item record as JSON lines, in submission order. The job's ownership is checked
        here, before the first line (NotFound otherwise), as a status call reads the job: on
        `conn`, a connection of `reads` the caller holds (else one is taken), by the prepared
        statement. An ORM read in a transaction of its own was planned anew every time: the
        transaction's rollback drops the connection's prepared statements (psycopg)."""
        if conn is None:
            with self.reads.connect() as own:
                read.job_record(own, caller, job_id)
        else:
            read.job_record(conn, caller, job_id)
        rows = results.of_job(self.engine, job_id, status=status, include_thinking=include_thinking)
        return read.jsonl(rows)

    def finished_times(self, caller: Caller, job_id: uuid.UUID) -> list[datetime]:
        with self.read_sessions() as session:
            read.get_job(session, caller, job_id)
            return read.finished_times(session, job_id)

    # --- cancel ------------------------------------------------------------------------------

    def cancel(self, caller: Caller, job_id: uuid.UUID) -> Job:
        """Pending items end at once, running ones are aborted by their workers. Cancelling
        twice while the first is under way is fine; a finished job is a Conflict."""
        with self.sessions() as session, session.begin():
            read.get_job(session, caller, job_id)
            outcome = ledger.cancel_job(session.connection(), job_id)
            if outcome is None:
                raise NotFound(str(job_id))
            changed, status = outcome
            if not changed and status != JobStatus.cancelling:
                raise Conflict(
                    f"job {job_id} is already {status}; only queued or running jobs cancel"
                )
        return self._load(job_id)
