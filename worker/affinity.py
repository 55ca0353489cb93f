"""On a CPU-only host, keep this process off the cores vLLM's compute threads are bound to, and
decide where vLLM's engine-core process runs.

On a CPU-only host vLLM binds the model's OpenMP threads to some cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default) and leaves the rest "reserved for other processes". It binds only the compute
threads: the engine core (its scheduler process) and this worker's threads (engine loop,
claimer, writer) are free to land on a compute core, and every time one of the worker's does,
the model's whole forward pass waits for it. On 2 cores (model threads on core 0, core 1
reserved) the benchmark job, in rounds alternating pinned and not, finished in a median 15.3 s
pinned against 16.6 s not (within that day's drift; kept because it is how vLLM means the
reserved cores to be used).

The engine core is another matter. While the model computes a step it polls for the result
(`sched_yield` in vLLM's shared-memory queue), and on the reserved core that polling took the
core from the worker: 2.24 s of a 2.81 s raw-engine round of 2,000 items x 16 tokens
(`python -m bench.engine_threads`). With one compute thread the model waits for the engine
core's schedule anyway, so beside that thread the poller only fills its gaps: one raw engine
whose engine core was moved between the two placements in alternating rounds ran as fast
beside the compute thread (`python -m bench.engine_core_placement`), and the job system,
given the reserved core back, came closer to the raw engine at 16 tokens (README,
Performance). With several compute threads a poller on one of their cores would hold up every
parallel region at its barrier, which no host here can measure, so `CPU_ENGINE_CORE=auto` (the
default) puts it beside the compute threads only when vLLM bound them to a single core and
otherwise keeps it with this worker; `compute` and `reserved` force one or the other.

Only on a CPU-only host. On a GPU host the model computes on the GPU, and a bound child is not
vLLM's CPU compute threads but, with NUMA binding on, a GPU worker bound to its GPU's node:
pinning anything there would be wrong, so nothing is changed.
"""

from __future__ import annotations

import logging
import os

import psutil

log = logging.getLogger(__name__)


def is_engine_core(proc: psutil.Process) -> bool:
    """vLLM names its engine-core process `VLLM::EngineCore` (setproctitle; the kernel's name
    for it keeps 15 characters)."""
    try:
        return proc.name().startswith("VLLM::EngineCor") or any(
            "VLLM::EngineCore" in part for part in proc.cmdline()
        )
    except psutil.Error:
        return False


def bound_cores(proc: psutil.Process, everything: set[int]) -> set[int]:
    """The cores this process's threads are bound to, when some are bound to fewer than
    `everything`: OpenMP runtimes bind each thread to its own core (KMP_AFFINITY,
    GOMP_CPU_AFFINITY), so the main thread's mask alone can name just one of them."""
    cores: set[int] = set()
    for thread in proc.threads():
        try:
            mask = os.sched_getaffinity(thread.id)
        except OSError:  # the thread ended meanwhile
            continue
        if mask < everything:
            cores |= mask
    return cores


def pin_threads(proc: psutil.Process, cores: set[int]) -> None:
    """Pin every thread `proc` has now to `cores` (one that ends meanwhile is passed over);
    threads it starts later inherit the mask of the thread that starts them."""
    for thread in proc.threads():
        try:
            os.sched_setaffinity(thread.id, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


def engine_core_cores(engine_core: str, compute: set[int], rest: set[int]) -> set[int]:
    """Where the engine core runs: `compute`, `reserved`, or `auto` (beside a single compute
    core, else on the reserved ones; the module's docstring says why)."""
    if engine_core == "compute" or (engine_core == "auto" and len(compute) == 1):
        return compute
    return rest


def keep_off_compute_cores(device: str, engine_core: str = "auto") -> set[int]:
    """On a CPU-only host (`device` 'cpu'), pin this process's threads, and its unbound
    descendants other than vLLM's engine core, to the cores that no descendant is bound to;
    the engine core goes where `engine_core_cores` says. Threads started later inherit the
    pinning from the thread that starts them. Returns the cores this process keeps to (empty
    when nothing was changed, and always on a GPU host)."""
    if device != "cpu" or not hasattr(os, "sched_setaffinity"):
        return set()
    me = psutil.Process()
    try:
        everything = set(me.cpu_affinity() or [])
        compute: set[int] = set()
        unbound: list[psutil.Process] = [me]
        for child in me.children(recursive=True):
            cores = bound_cores(child, everything)
            if cores:
                compute |= cores  # a process vLLM bound its compute threads to
            else:
                unbound.append(child)
    except psutil.Error as error:
        log.info("CPU affinity left alone: %s", error)
        return set()
    rest = everything - compute
    if not compute or not rest:
        return set()
    scheduler = engine_core_cores(engine_core, compute, rest)
    for proc in unbound:
        cores = scheduler if proc.pid != me.pid and is_engine_core(proc) else rest
        try:
            pin_threads(proc, cores)
        except (psutil.Error, OSError) as error:  # the process ended, or no permission
            log.info("could not pin process %d: %s", proc.pid, error)
    log.info("vLLM computes on cores %s and its engine core runs on %s; this worker keeps to %s",
             sorted(compute), sorted(scheduler), sorted(rest))  # fmt: skip
    return rest
