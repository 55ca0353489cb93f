"""Every write to the database, as SQL on one connection: every state change of items (fenced),
and the rows a submission, an upload or a key adds. The worker, the sweeper, the job service and
the API all write through here.

Two rules keep this correct under concurrency:

* A transaction that changes items first locks their job rows, in id order (`lock_jobs`), in
  one of three strengths (`Lock`); taking the locks up front, in one order, means two
  transactions can never deadlock over them. Claims and a worker's writes take the weakest,
  which none of them waits for; a change of the job's status takes the strongest, so a cancel
  cannot interleave with them. A write that ends items then adds to their jobs' counts
  (`counts`), which takes the rows in id order again, at the middle strength, as its last step;
  a worker's stores add to delta rows of their own instead, so that a job's workers never
  queue on its row, and the row takes the deltas when the job is finalized or swept.
* A write from a worker is fenced: it applies only while the item is still `running` under the
  same `lease_owner` and `attempts` that the claim handed out. A late, duplicate or superseded
  delivery therefore changes nothing, and an item holds at most one result (primary key).

The parts, each importing only those above it: `statuses` and `rows` (the shared constants and
row types), `locks` (the first rule), `counts` (a job's counts), `claims`, `jobs` (job status
changes), `items` (the fenced writes of the second rule, and the releases), `hints` and
`workers`; and the writes that are not item state changes: `submits` (a submission's job row
and items), `files` (the OpenAI Files API's rows and bytes) and `keys` (API keys).
"""

from thinkbatch.ledger.claims import ModelFilter
from thinkbatch.ledger.claims import claim
from thinkbatch.ledger.claims import has_pending
from thinkbatch.ledger.claims import has_suspects
from thinkbatch.ledger.counts import Counts
from thinkbatch.ledger.counts import add as add_counts
from thinkbatch.ledger.counts import fold as fold_counts
from thinkbatch.ledger.files import delete_file
from thinkbatch.ledger.files import expire_files
from thinkbatch.ledger.files import insert_chunk
from thinkbatch.ledger.files import insert_outputs
from thinkbatch.ledger.files import insert_upload
from thinkbatch.ledger.files import set_size
from thinkbatch.ledger.hints import job_models
from thinkbatch.ledger.hints import job_to_adopt
from thinkbatch.ledger.hints import mark_hinted
from thinkbatch.ledger.hints import stale_jobs
from thinkbatch.ledger.items import complete
from thinkbatch.ledger.items import end_items
from thinkbatch.ledger.items import fail
from thinkbatch.ledger.items import release
from thinkbatch.ledger.items import release_crashed
from thinkbatch.ledger.items import release_lapsed
from thinkbatch.ledger.jobs import ToDrive
from thinkbatch.ledger.jobs import cancel_job
from thinkbatch.ledger.jobs import expire_job
from thinkbatch.ledger.jobs import fail_job
from thinkbatch.ledger.jobs import finalize_if_done
from thinkbatch.ledger.jobs import finalize_jobs
from thinkbatch.ledger.jobs import job_to_drive
from thinkbatch.ledger.keys import insert_key
from thinkbatch.ledger.keys import revoke_key
from thinkbatch.ledger.locks import Lock
from thinkbatch.ledger.locks import job_state
from thinkbatch.ledger.locks import lock_jobs
from thinkbatch.ledger.rows import Claimed
from thinkbatch.ledger.rows import Done
from thinkbatch.ledger.rows import Failed
from thinkbatch.ledger.rows import JobState
from thinkbatch.ledger.rows import Locked
from thinkbatch.ledger.statuses import RUNNABLE
from thinkbatch.ledger.statuses import RUNNABLE_SQL
from thinkbatch.ledger.statuses import UNFINISHED
from thinkbatch.ledger.statuses import UNFINISHED_SQL
from thinkbatch.ledger.statuses import sql_in
from thinkbatch.ledger.submits import NewJob
from thinkbatch.ledger.submits import analyze_items
from thinkbatch.ledger.submits import copy_items
from thinkbatch.ledger.submits import find_by_key
from thinkbatch.ledger.submits import insert_job
from thinkbatch.ledger.submits import insert_refused_job
from thinkbatch.ledger.submits import lock_tenant
from thinkbatch.ledger.submits import settle_job
from thinkbatch.ledger.submits import stored_items
from thinkbatch.ledger.workers import NameClash
from thinkbatch.ledger.workers import ServedNameTaken
from thinkbatch.ledger.workers import beat
from thinkbatch.ledger.workers import mark_stopped
from thinkbatch.ledger.workers import name_clashes
from thinkbatch.ledger.workers import owners_to_release
from thinkbatch.ledger.workers import register_worker
from thinkbatch.ledger.workers import stop_silent_workers

__all__ = [
    "analyze_items",
    "RUNNABLE",
    "RUNNABLE_SQL",
    "UNFINISHED",
    "UNFINISHED_SQL",
    "Claimed",
    "Counts",
    "Done",
    "Failed",
    "JobState",
    "Lock",
    "Locked",
    "ModelFilter",
    "NameClash",
    "NewJob",
    "ToDrive",
    "add_counts",
    "fold_counts",
    "beat",
    "cancel_job",
    "claim",
    "complete",
    "copy_items",
    "delete_file",
    "end_items",
    "expire_files",
    "expire_job",
    "fail",
    "fail_job",
    "finalize_if_done",
    "finalize_jobs",
    "find_by_key",
    "has_pending",
    "has_suspects",
    "insert_chunk",
    "insert_job",
    "insert_key",
    "insert_outputs",
    "insert_refused_job",
    "insert_upload",
    "job_state",
    "job_models",
    "job_to_adopt",
    "job_to_drive",
    "lock_jobs",
    "lock_tenant",
    "mark_hinted",
    "mark_stopped",
    "name_clashes",
    "owners_to_release",
    "register_worker",
    "ServedNameTaken",
    "release",
    "release_crashed",
    "release_lapsed",
    "revoke_key",
    "set_size",
    "settle_job",
    "sql_in",
    "stale_jobs",
    "stop_silent_workers",
    "stored_items",
]
