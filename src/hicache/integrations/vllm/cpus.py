"""Which CPUs the cache's threads use inside vLLM's CPU worker: the cores vLLM reserved, not its model's.

In multi-process mode vLLM binds its worker's OpenMP threads to all but the reserved cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU``; ``vllm/utils/ompmultiprocessing.py``), each thread to one core,
the worker's main thread (OpenMP's thread 0) to the first. A thread started from that thread
inherits its binding, so hicache's event loop and its I/O threads (backups to the host tier,
storage writes, the channel's lookups) would compete with the model on its own cores while the
reserved ones, kept for the engine core and connectors, idle. The worker moves the cache's loop
thread onto the reserved cores before the cache starts; the threads it starts inherit that.

The model's cores are those of every thread of the worker process, not the main thread's alone:
with nothing reserved the main thread holds core 0 and an OpenMP thread core 1, and core 1 is not
spare. Where nothing is spare (single-process mode, or every core given to OpenMP) nothing
changes: the cache's threads run where the process may.
"""

from __future__ import annotations

import logging
import os

__all__ = ["model_cpus", "reserved_cpus", "use_cpus"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own


def model_cpus() -> set[int]:
    """The CPUs the threads of this process are bound to, together (the calling thread's if the
    others cannot be read)."""
    cpus = set(os.sched_getaffinity(0))
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return cpus
    for tid in tids:
        try:
            cpus |= os.sched_getaffinity(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return cpus


def reserved_cpus() -> tuple[set[int], set[int]] | None:
    """(the CPUs the model's threads are bound to, the ones its process may use besides), or None.

    Call from vLLM's worker thread, after its OpenMP threads are bound (vLLM binds them when the
    worker starts). The process's allowed CPUs are those of its parent (vLLM's engine core, which
    binds nothing); None where that cannot be read or nothing is left over.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        mine = model_cpus()
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        return None
    spare = allowed - mine
    return (mine, spare) if spare else None


def use_cpus(cpus: set[int]) -> None:
    """Bind the calling thread (and the threads it starts from now on) to ``cpus``."""
    os.sched_setaffinity(0, cpus)
