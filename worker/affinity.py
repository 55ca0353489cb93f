"""On a CPU-only host, keep this process off the cores vLLM's compute threads are bound to, and
put vLLM's engine-core process beside those threads.

On a CPU-only host vLLM binds the model's OpenMP threads to some cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default) and leaves the rest "reserved for other processes". It binds only the compute
threads: the engine core (its scheduler process) and this worker's threads (engine loop,
claimer, writer) are free to land on a compute core, and every time one of the worker's does,
the model's whole forward pass waits for it. On 2 cores (model threads on core 0, core 1
reserved) the benchmark job, in rounds alternating pinned and not, finished in a median 15.3 s
pinned against 16.6 s not (within that day's drift; kept because it is how vLLM means the
reserved cores to be used).

The engine core is another matter. While the model computes a step it polls for the result,
and polling on the reserved core took that core from the worker: in a raw-engine round of
2,000 items x 16 tokens it used 2.24 s of the round's 2.81 s there (`python -m
bench.engine_threads`). Beside the compute threads it only fills their gaps (it yields while
polling, and the model waits for its schedule anyway): the raw engine ran as fast (635, 569
and 619 items/s against 617, 582 and 605 in alternating runs) on half the engine CPU, and the
job system's ratio to it at 16 tokens went from 0.94, 0.81 and 0.90 to 0.96, 0.95 and 1.04
(README, Performance). `CPU_ENGINE_CORE=reserved` keeps vLLM's own placement, for a host whose
measurements say otherwise.

Only on a CPU-only host. On a GPU host the model computes on the GPU, and a bound child is not
vLLM's CPU compute threads but, with NUMA binding on, a GPU worker bound to its GPU's node:
pinning anything there would be wrong, so nothing is changed.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)


def keep_off_compute_cores(device: str, engine_core: str = "compute") -> set[int]:
    """On a CPU-only host (`device` 'cpu'), pin this process's threads to the cores that no
    descendant is bound to, and its unbound descendants (vLLM's engine core) to the cores the
    bound ones use (`engine_core` 'compute') or to the same cores as this process ('reserved').
    Threads started later inherit the pinning from the thread that starts them. Returns the
    cores this process keeps to (empty when nothing was changed, and always on a GPU host)."""
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
        cores = compute if engine_core == "compute" and proc.pid != me.pid else rest
        try:
            for thread in proc.threads():
                os.sched_setaffinity(thread.id, cores)
        except (psutil.Error, OSError) as error:  # a thread may end meanwhile; best effort
            log.info("could not pin process %d: %s", proc.pid, error)
    log.info("vLLM computes on cores %s, its engine core runs on %s; this worker keeps to %s",
             sorted(compute), sorted(compute if engine_core == "compute" else rest),
             sorted(rest))  # fmt: skip
    return rest
