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

import time
from datetime import UTC
from datetime import datetime
from datetime import timedelta

import pytest

from tests.hosts.helpers import PARAMS
from tests.hosts.helpers import REPORTS
from tests.hosts.helpers import VLLM_HOST_ENV
from tests.hosts.helpers import Fleet
from tests.hosts.helpers import Lab
from tests.hosts.helpers import Worker
from tests.hosts.helpers import finish
from tests.hosts.helpers import items
from tests.hosts.helpers import open_transaction
from tests.hosts.helpers import share
from tests.hosts.helpers import stored_by
from tests.hosts.helpers import wait_for
from tests.hosts.helpers import worker_row
from tests.hosts.netns import DB_ADDR
from tests.hosts.netns import REDIS_ADDR

pytestmark = pytest.mark.hosts


def test_a_host_joining_mid_job_takes_a_share(lab: Lab) -> None:
    with Fleet(lab, "join") as fleet:
        fleet.start("h1", "h2")
        job = lab.client.submit(items(480), params=PARAMS)
        lab.client.wait(job["id"], done=96)
        (h3,) = fleet.start("h3")
        joined = datetime.now(UTC)
        wait_for(lambda: share(lab.db, job["id"], h3)[1] > 0, 30, "h3 stored results")
        done = finish(lab, "1. a host joins mid-job", job["id"], faults=0, fault_at=joined)
        took = stored_by(lab.db, job["id"], h3)
        REPORTS[-1].note = f"h3 stored {took} of {done['counts']['total']}"
        assert took >= 32, REPORTS[-1].note  # more than one claim's worth: a real share


def holding(lab: Lab, job_id: str, worker: Worker, least: int = 8) -> int:
    """The worker's leases in the job once it holds at least `least` and has stored results
    (so the fault lands mid-job, on a worker at work); 0 until then."""
    held, stored = share(lab.db, job_id, worker)
    return held if held >= least and stored > 0 else 0


def test_a_host_cut_off_while_holding_leases(lab: Lab) -> None:
    with Fleet(lab, "partition") as fleet:
        h1, _h2, _h3 = fleet.start("h1", "h2", "h3")
        job = lab.client.submit(items(900), params=PARAMS)
        wait_for(lambda: holding(lab, job["id"], h1), 60, "h1 at work on the job")
        # The link goes while one of h1's transactions holds the job's lock, as a store does.
        with open_transaction(h1, job["id"]):
            lab.network.cut(h1.host)
            cut_at = datetime.now(UTC)
            time.sleep(1)  # a write already on its way when the link went lands or not by now
            held = share(lab.db, job["id"], h1)[0]
            assert held > 0
            # h1 stops beating; the fleet judges it dead, takes its items back and finishes
            # the job while h1, cut off, computes them too.
            wait_for(lambda: worker_row(lab.db, h1).stopped_at is not None, 30, "h1 dead")
            released = wait_for(
                lambda: share(lab.db, job["id"], h1)[0] == 0 and datetime.now(UTC),
                30,
                "h1's leases released",
            )
            lab.client.wait(job["id"], timeout=120)
        cut_s = (datetime.now(UTC) - cut_at).total_seconds()
        lab.network.heal(h1.host)
        healed = datetime.now(UTC)
        # Back on the network, h1 writes what it computed: every write is refused by the fence,
        # logged, and counted on its /metrics.
        wait_for(h1.fenced_in_log, 60, "h1 logs its refused writes")
        fenced = h1.fenced()  # the same count in its log and on its /metrics
        assert 0 < fenced <= held, (fenced, held)
        assert stored_by(lab.db, job["id"], h1, after=cut_at + timedelta(seconds=1)) == 0
        finish(lab, "2. partition while holding leases", job["id"], faults=1, fault_at=cut_at,
               fenced=fenced,
               note=f"h1 held {held}, back in {(released - cut_at).total_seconds():.0f}s; "
               f"cut {cut_s:.0f}s")  # fmt: skip
        # Its engine carries on: h1 beats again and takes a share of the next job.
        after = lab.client.submit(items(200, "after"), params=PARAMS)
        wait_for(lambda: stored_by(lab.db, after["id"], h1) > 0, 60, "h1 stores new results")
        assert worker_row(lab.db, h1).stopped_at is None
        done = finish(lab, "2b. the next job, h1 back", after["id"], faults=0, fault_at=healed)
        took = stored_by(lab.db, after["id"], h1)
        REPORTS[-1].note = f"h1 stored {took} of {done['counts']['total']}"


LOSSY_S = 30


def test_a_lossy_link_for_30_s(lab: Lab) -> None:
    with Fleet(lab, "lossy") as fleet:
        h1, _h2, _h3 = fleet.start("h1", "h2", "h3")
        job = lab.client.submit(items(1200), params=PARAMS)
        wait_for(lambda: holding(lab, job["id"], h1), 60, "h1 at work on the job")
        lab.network.lossy(h1.host, loss_pct=20, rate_kbit=256)
        began = datetime.now(UTC)
        time.sleep(LOSSY_S)
        dropped = lab.network.dropped(h1.host)
        lab.network.heal(h1.host)
        during = stored_by(lab.db, job["id"], h1, after=began)
        assert dropped > 0
        lab.client.wait(job["id"], timeout=120)
        fenced = h1.fenced()  # late writes, if h1 was judged dead while its beats were lost
        finish(lab, "3. lossy link 30s (20% loss, 256kbit/s)", job["id"], faults=1,
               fault_at=began, fenced=fenced,
               note=f"{dropped} packets dropped; h1 stored {during} meanwhile")  # fmt: skip


REDIS_LOST_S = 30


def test_redis_lost_from_one_host(lab: Lab) -> None:
    with Fleet(lab, "no-redis") as fleet:
        h1, _h2, _h3 = fleet.start("h1", "h2", "h3")
        job = lab.client.submit(items(900), params=PARAMS)
        wait_for(lambda: holding(lab, job["id"], h1), 60, "h1 at work on the job")
        lab.network.block(h1.host, REDIS_ADDR)
        began = datetime.now(UTC)
        # Hints are only hints: h1 keeps claiming and storing through PostgreSQL, and beats.
        wait_for(lambda: stored_by(lab.db, job["id"], h1, after=began) >= 32, 60,
                 "h1 stores results without Redis")  # fmt: skip
        lab.client.wait(job["id"], timeout=120)
        assert worker_row(lab.db, h1).stopped_at is None  # never judged dead
        during = stored_by(lab.db, job["id"], h1, after=began)
        # Long enough for its broker connections to be found dead and be tried again.
        time.sleep(max(0.0, REDIS_LOST_S - (datetime.now(UTC) - began).total_seconds()))
        lab.network.heal(h1.host)
        healed = datetime.now(UTC)
        fenced = h1.fenced()
        finish(lab, "4. Redis lost from one host", job["id"], faults=1, fault_at=began,
               fenced=fenced, note=f"h1 stored {during} without Redis")  # fmt: skip
        assert fenced == 0  # it kept its leases: nothing of its was superseded
        # With Redis back, h1 takes hints again: a share of the next job.
        after = lab.client.submit(items(200, "after"), params=PARAMS)
        wait_for(lambda: stored_by(lab.db, after["id"], h1) > 0, 30, "h1 stores new results")
        done = finish(lab, "4b. the next job, Redis back", after["id"], faults=0,
                      fault_at=healed)  # fmt: skip
        took = stored_by(lab.db, after["id"], h1)
        REPORTS[-1].note = f"h1 stored {took} of {done['counts']['total']}"


@pytest.mark.engine  # its h1 runs vLLM: in the engine's unit (tests/streams.py)
def test_postgres_lost_from_one_host_running_vllm(lab: Lab) -> None:
    # The one scenario on the real engine: h1 runs vLLM (CPU, the demo model), which computes
    # on while its host cannot reach PostgreSQL, and goes on to the next job once it can.
    with Fleet(lab, "no-postgres") as fleet:
        h1, _h2, _h3 = fleet.start("h1", "h2", "h3", env={"h1": VLLM_HOST_ENV})
        job = lab.client.submit(items(900), params=PARAMS)
        wait_for(lambda: holding(lab, job["id"], h1), 60, "h1 at work on the job")
        lab.network.block(h1.host, DB_ADDR)
        began = datetime.now(UTC)
        time.sleep(1)
        held = share(lab.db, job["id"], h1)[0]
        # Its heartbeats stop; the fleet takes its items and finishes the job.
        wait_for(lambda: worker_row(lab.db, h1).stopped_at is not None, 30, "h1 judged dead")
        released = wait_for(
            lambda: share(lab.db, job["id"], h1)[0] == 0 and datetime.now(UTC),
            30,
            "h1's leases released",
        )
        lab.client.wait(job["id"], timeout=120)
        lab.network.heal(h1.host)
        healed = datetime.now(UTC)
        wait_for(h1.fenced_in_log, 60, "h1 logs its refused writes")
        fenced = h1.fenced()  # the same count in its log and on its /metrics
        assert 0 < fenced <= held, (fenced, held)
        assert stored_by(lab.db, job["id"], h1, after=began + timedelta(seconds=1)) == 0
        back_s = (released - began).total_seconds()
        finish(lab, "5. Postgres lost from one host (vLLM)", job["id"], faults=1, fault_at=began,
               fenced=fenced, note=f"h1 held {held}, back in {back_s:.0f}s")  # fmt: skip
        after = lab.client.submit(items(200, "after"), params=PARAMS)
        wait_for(lambda: stored_by(lab.db, after["id"], h1) > 0, 60, "h1 stores new results")
        assert worker_row(lab.db, h1).stopped_at is None
        done = finish(lab, "5b. the next job, Postgres back", after["id"], faults=0,
                      fault_at=healed)  # fmt: skip
        took = stored_by(lab.db, after["id"], h1)
        REPORTS[-1].note = f"h1 stored {took} of {done['counts']['total']}"
