"""The hosts' network, on one machine: network namespaces joined by veth links to a bridge,
and the faults of a real network (a cut link, a lossy one, one unreachable service), made
with iproute2 and tc netem. Needs root.

One run's layout (P = `tbh<pid>`, so that runs side by side never touch each other's):

    P-svc   PostgreSQL on DB_ADDR, Redis on REDIS_ADDR (both on its bridge br0), the API
    P-h1    one worker; eth0 (HOST_NET.N) is a veth whose other end, h1, is a port of br0
    P-h2    ...

No address is added to the machine's own namespace and no namespace has a default route, so a
packet can only travel between these namespaces. The tests themselves stay outside: they reach
PostgreSQL, Redis and the API through Unix sockets (files, seen from every namespace).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "tbh"  # every namespace of this tier is named tbh<pid of the run>-...
SUBNET = "10.213.0"  # inside the run's namespaces only (no route leads there from outside)
DB_ADDR = f"{SUBNET}.2"
REDIS_ADDR = f"{SUBNET}.3"
_NAME = re.compile(rf"^{PREFIX}(\d+)-")


def run(*args: str) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


def available() -> str | None:
    """Why this machine cannot run the tier, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth links and tc queueing disciplines)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (`ip` and `tc`)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        run("ip", "netns", "add", probe)
    except RuntimeError as error:
        return f"`ip netns` is unavailable here: {error}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


def remove_namespace(name: str) -> None:
    """Kill what still runs in the namespace (only this tier's processes live there), then
    delete it; its veth ends, and so their peers and the bridge ports, go with it."""
    pids = [int(p) for p in run("ip", "netns", "pids", name).split()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [int(p) for p in run("ip", "netns", "pids", name).split()]
        time.sleep(0.05)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)


def scratch_dir(prefix: str) -> Path:
    """A folder of the run outside pytest's: a pytest starting anywhere on the machine takes
    the other users' access to pytest's temporary root away again, and PostgreSQL's data
    folder must stay open to the user the server runs as."""
    path = Path(tempfile.gettempdir()) / f"{prefix}-data"
    path.mkdir(mode=0o755)
    return path


def remove_leftovers() -> list[str]:
    """Namespaces and scratch folders of earlier runs of this tier whose process is gone (a
    run killed before its finalizers ran); returns their names."""
    gone = []
    for name in namespaces():
        match = _NAME.match(name)
        if match and not _alive(int(match.group(1))):
            remove_namespace(name)
            gone.append(name)
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-data"):
        match = _NAME.match(path.name)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(str(path))
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Host:
    name: str  # h1, h2, ...
    netns: str
    addr: str
    port: str  # its link's end on the bridge, in the services' namespace


class Network:
    """The services' namespace and `hosts` host namespaces, each linked to the bridge."""

    def __init__(self, hosts: int = 3):
        self.prefix = f"{PREFIX}{os.getpid()}"
        self.svc = f"{self.prefix}-svc"
        self.hosts = [
            Host(f"h{n}", f"{self.prefix}-h{n}", f"{SUBNET}.{10 + n}", f"h{n}")
            for n in range(1, hosts + 1)
        ]
        self._made: list[str] = []

    def up(self) -> Network:
        try:
            self._add_namespace(self.svc)
            svc = ("ip", "-n", self.svc)
            run(*svc, "link", "add", "br0", "type", "bridge")
            run(*svc, "addr", "add", f"{DB_ADDR}/24", "dev", "br0")
            run(*svc, "addr", "add", f"{REDIS_ADDR}/24", "dev", "br0")
            run(*svc, "link", "set", "br0", "up")
            for host in self.hosts:
                self._add_namespace(host.netns)
                # Made inside the two namespaces: no interface ever appears outside them.
                run("ip", "link", "add", "eth0", "netns", host.netns, "type", "veth",
                    "peer", "name", host.port, "netns", self.svc)  # fmt: skip
                run(*svc, "link", "set", host.port, "master", "br0", "up")
                run("ip", "-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
                run("ip", "-n", host.netns, "link", "set", "eth0", "up")
        except BaseException:
            self.down()
            raise
        return self

    def _add_namespace(self, name: str) -> None:
        run("ip", "netns", "add", name)
        self._made.append(name)
        run("ip", "-n", name, "link", "set", "lo", "up")

    def down(self) -> None:
        for name in reversed(self._made):
            remove_namespace(name)
        self._made.clear()

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    # --- faults ------------------------------------------------------------------------------
    # Made of the queueing disciplines every Linux build has (HTB, pfifo and the BPF
    # classifier), not netem: the kernel of the machine this tier was written on has none
    # (CONFIG_NET_SCH_NETEM unset). A qdisc acts on what leaves an interface, so each fault is
    # put on both ends of the host's link, one per direction.

    def _ends(self, host: Host) -> list[tuple[str, str]]:
        return [(host.netns, "eth0"), (self.svc, host.port)]

    def cut(self, host: Host) -> None:
        """A partition: every packet to and from the host is dropped, silently (a queue of no
        room), with the link up: its connections stay open and unanswered, as behind a dead
        switch, until a timeout says otherwise."""
        for netns, dev in self._ends(host):
            tc(netns, "qdisc", "replace", "dev", dev, "root", "pfifo", "limit", "0")

    def lossy(self, host: Host, *, loss_pct: float, rate_kbit: int) -> None:
        """A bad link: each packet is dropped at random with `loss_pct` % odds (in each
        direction), and the rest pass through a `rate_kbit` pipe, whose queue delays them (a
        round trip waits behind what is queued before it) and overflows into more losses."""
        threshold = int(loss_pct / 100 * 2**32)
        for netns, dev in self._ends(host):
            tc(netns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
               "default", "1")  # fmt: skip
            tc(netns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
               "rate", f"{rate_kbit}kbit", "ceil", f"{rate_kbit}kbit")  # fmt: skip
            tc(netns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:2", "htb",
               "rate", f"{rate_kbit}kbit")  # fmt: skip
            # A queue of no room: what is sent to class 1:2 is dropped.
            tc(netns, "qdisc", "add", "dev", dev, "parent", "1:2", "pfifo", "limit", "0")
            # Classic BPF: load a random 32-bit number (the ancillary load SKF_AD_RANDOM);
            # below the threshold the packet goes to 1:2 (0x10002), otherwise it is not
            # classified and takes the default class 1:1.
            program = [
                (0x20, 0, 0, 0xFFFFF000 + 56),  # ld rand
                (0x35, 1, 0, threshold),  # jge threshold: keep it
                (0x06, 0, 0, 0x10002),  # ret 1:2, dropped
                (0x06, 0, 0, 0),  # ret 0, not classified: the default class
            ]
            bytecode = f"{len(program)}," + ",".join(f"{c} {t} {f} {k}" for c, t, f, k in program)
            tc(netns, "filter", "add", "dev", dev, "parent", "1:", "protocol", "all", "prio",
               "1", "bpf", "bytecode", bytecode, "flowid", "1:1")  # fmt: skip

    def dropped(self, host: Host) -> int:
        """Packets the faults on the host's link have dropped so far (both ends)."""
        total = 0
        for netns, dev in self._ends(host):
            out = run("ip", "netns", "exec", netns, "tc", "-s", "qdisc", "show", "dev", dev)
            # The root qdisc comes first; its count includes its classes' drops.
            found = re.search(r"dropped (\d+)", out)
            total += int(found.group(1)) if found else 0
        return total

    def block(self, host: Host, addr: str) -> None:
        """The host loses one service: packets to `addr` vanish (a blackhole route), while the
        link and the other service stay up."""
        run("ip", "-n", host.netns, "route", "add", "blackhole", f"{addr}/32")

    def heal(self, host: Host) -> None:
        """Undo every fault on the host's link."""
        for netns, dev in self._ends(host):
            subprocess.run(
                ["ip", "netns", "exec", netns, "tc", "qdisc", "del", "dev", dev, "root"],
                capture_output=True,
            )
        for addr in (DB_ADDR, REDIS_ADDR):
            subprocess.run(
                ["ip", "-n", host.netns, "route", "del", "blackhole", f"{addr}/32"],
                capture_output=True,
            )


def tc(netns: str, *args: str) -> None:
    run("ip", "netns", "exec", netns, "tc", *args)
