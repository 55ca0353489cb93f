"""Several hosts on one machine (tests/hosts/netns.py): three workers, each in a network
namespace of its own, reach PostgreSQL and Redis over a link of their own, and the network
fails under them: a host joins mid-job, one is cut off while it holds leases and keeps
computing, one sits behind a lossy link, one loses only Redis, one only PostgreSQL.

Every scenario ends with the invariants of tests/helpers.check_invariants (every item terminal,
one result per item, counts equal to a count over the items, no item running without a live
lease), 0 lost and 0 duplicated; the ones whose faulty host comes back with results it can no
longer store check that each of those late writes was refused by the fence, logged and counted
on the worker's /metrics."""

from __future__ import annotations

from datetime import UTC
from datetime import datetime

import pytest

from tests.hosts.helpers import PARAMS
from tests.hosts.helpers import Fleet
from tests.hosts.helpers import Lab
from tests.hosts.helpers import finish
from tests.hosts.helpers import items
from tests.hosts.helpers import share
from tests.hosts.helpers import stored_by
from tests.hosts.helpers import wait_for

pytestmark = pytest.mark.hosts


def test_a_host_joining_mid_job_takes_a_share(lab: Lab) -> None:
    fleet = Fleet(lab, "join")
    try:
        fleet.start("h1", "h2")
        job = lab.client.submit(items(600), params=PARAMS)
        lab.client.wait(job["id"], done=120)
        (h3,) = fleet.start("h3")
        joined = datetime.now(UTC)
        wait_for(lambda: share(lab.db, job["id"], h3)[1] > 0, 30, "h3 stored results")
        done = finish(lab, "1. a host joins mid-job", job["id"], faults=0, fault_end=joined)
        took = stored_by(lab.db, job["id"], h3)
        lab_note = f"h3 stored {took} of {done['counts']['total']}"
        assert took >= 32, lab_note  # more than one claim's worth: a real share
        from tests.hosts.helpers import REPORTS

        REPORTS[-1].note = lab_note
    finally:
        fleet.stop()
