"""Keep this process and vLLM's scheduler off the cores vLLM's compute threads are bound to.

On a CPU-only host vLLM binds the model's OpenMP threads to some cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default) and leaves the rest "reserved for other processes": its own engine-core
(scheduler) process and the serving frontend, which here is this worker. It binds only the compute
threads, though: the engine core and the worker's threads (engine loop, claimer, writer) are free
to land on a compute core, and every time one does, the model's whole forward pass waits for it.
On 2 cores (model threads on core 0, core 1 reserved) the benchmark job, in rounds alternating
pinned and not, finished in a median 15.3 s pinned against 16.6 s not. That is within the
host's drift between rounds (13.9-18.2 s that day); it is kept because it is how vLLM means the
reserved cores to be used.

Only on a CPU-only host. On a GPU host the model computes on the GPU, and a bound child is not
vLLM's CPU compute threads but, with NUMA binding on, a GPU worker bound to its GPU's node:
pinning the worker off those cores would be wrong, so nothing is changed there.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)


def keep_off_compute_cores(device: str) -> set[int]:
    """On a CPU-only host (`device` 'cpu'), pin this process's threads and its unbound
    descendants to the cores that no descendant is bound to. Threads started later inherit the
    pinning from the thread that starts them. Returns the cores kept to (empty when nothing was
    changed, and always on a GPU host)."""
    if device != "cpu" or not hasattr(os, "sched_setaffinity"):
        return set()
    me = psutil.Process()
    try:
        everything = set(me.cpu_affinity() or [])
        children = me.children(recursive=True)
        compute: set[int] = set()
        unbound: list[psutil.Process] = [me]
        for child in children:
            cores = set(child.cpu_affinity() or [])
            if cores and cores < everything:
                compute |= cores  # a process vLLM bound its compute threads to
            else:
                unbound.append(child)
    except psutil.Error as error:
        log.info("CPU affinity left alone: %s", error)
        return set()
    rest = everything - compute
    if not compute or not rest:
        return set()
    for proc in unbound:
        try:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, rest)
        except (psutil.Error, OSError) as error:  # a thread may end meanwhile; best effort
            log.info("could not pin process %d: %s", proc.pid, error)
    log.info("vLLM computes on cores %s; this worker and the engine core keep to %s",
             sorted(compute), sorted(rest))  # fmt: skip
    return rest
