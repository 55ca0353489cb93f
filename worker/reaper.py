"""Kill a dead worker's engine processes.

vLLM runs its engine core in a child process. If the worker is killed (SIGKILL, OOM killer) that
child lives on as an orphan, and on a GPU host it keeps the GPU's memory, so the restarted
worker cannot load the model. The worker therefore starts this small watchdog, writes it the
pids of its engine processes, and keeps the write end of a pipe open for life. When the pipe
reaches end-of-file the worker is gone, however it died, and the watchdog kills what is left.

Run as `python -m worker.reaper FD`; it imports only psutil.
"""

from __future__ import annotations

import os
import subprocess
import sys

import psutil


def spawn_reaper() -> tuple[subprocess.Popen[bytes], int]:
    """Start the watchdog; returns it and the write end of the pipe (keep it open)."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.reaper", str(read_end)],
        pass_fds=(read_end,),
        stdin=subprocess.DEVNULL,
        # Its own session: a signal sent to the worker's process group must not kill it.
        start_new_session=True,
    )
    os.close(read_end)
    return proc, write_end


def watch_processes(write_end: int, exclude: set[int]) -> list[int]:
    """Tell the watchdog about every current descendant of this process but `exclude`."""
    me = psutil.Process()
    watched = []
    for child in me.children(recursive=True):
        if child.pid in exclude:
            continue
        os.write(write_end, f"{child.pid} {child.create_time()}\n".encode())
        watched.append(child.pid)
    return watched


def _kill_tree(pid: int, created: float) -> None:
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.01:
            return  # the pid was reused by an unrelated process
        victims = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def main(read_end: int) -> None:
    watched: dict[int, float] = {}
    buffer = b""
    while True:
        chunk = os.read(read_end, 4096)
        if not chunk:
            break  # every write end is closed: the worker has exited
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            pid_field, created_field = line.split()
            watched[int(pid_field)] = float(created_field)
    for pid, created in watched.items():
        _kill_tree(pid, created)


if __name__ == "__main__":
    main(int(sys.argv[1]))
