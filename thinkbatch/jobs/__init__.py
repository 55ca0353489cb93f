"""The job service: its front door (`JobService`), its wire models, and the one row type an
item's outcome is read in. Callers (the REST API, the OpenAI facade, the dashboard, the CLI's
and the benchmarks' in-process paths) use only what this package exports.

Modules, each one concern: `service` (the front door), `create` (a submission's checks and item
rows), `budgets` (thinking_budget against max_tokens over a whole job), `context` (an item's
floor of tokens against the model's context), `quotas` (per-tenant limits), `read` (reading and
paging jobs), `results` (the outcome rows), `stats` (thinking statistics), `planner` (the
items table's statistics after a large submit), `prefix` (an item's claim key), `wire` (the
pydantic models of the REST API, which are also its serializers).
"""

from thinkbatch.jobs.create import RefusedItem
from thinkbatch.jobs.read import job_out
from thinkbatch.jobs.read import parse_item_status
from thinkbatch.jobs.read import parse_job_id
from thinkbatch.jobs.results import ResultRow
from thinkbatch.jobs.results import of_job as result_rows
from thinkbatch.jobs.service import JobService
from thinkbatch.jobs.service import Origin
from thinkbatch.jobs.service import Submitted
from thinkbatch.jobs.service import digest_of
from thinkbatch.jobs.wire import ItemIn
from thinkbatch.jobs.wire import JobHeader
from thinkbatch.jobs.wire import JobOut
from thinkbatch.jobs.wire import Message
from thinkbatch.jobs.wire import SamplingParamsIn

__all__ = [
    "ItemIn",
    "JobHeader",
    "JobOut",
    "JobService",
    "Message",
    "Origin",
    "RefusedItem",
    "ResultRow",
    "SamplingParamsIn",
    "Submitted",
    "digest_of",
    "job_out",
    "parse_item_status",
    "parse_job_id",
    "result_rows",
]
