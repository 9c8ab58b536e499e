"""Which CPUs the cache's threads use inside vLLM's CPU worker: the cores vLLM reserved, not its model's.

In multi-process mode vLLM binds its worker's OpenMP threads to all but the reserved cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU``; ``vllm/utils/ompmultiprocessing.py``), and binds the worker's
main thread with them. A thread started from that thread inherits the binding, so hicache's event
loop and its I/O threads (backups to the host tier, storage writes, the channel's lookups) would
compete with the model on its own cores while the reserved ones, kept for the engine core and
connectors, idle. The worker moves the cache's loop thread onto the reserved cores before the
cache starts; the threads it starts inherit that. Where nothing is reserved (single-process mode,
or every core given to OpenMP) nothing changes.
"""

from __future__ import annotations

import logging
import os

__all__ = ["reserved_cpus", "use_cpus"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own


def reserved_cpus() -> tuple[set[int], set[int]] | None:
    """(the CPUs the calling thread is bound to, the ones its process may use besides), or None.

    Call from vLLM's worker thread. The process's allowed CPUs are those of its parent (vLLM's
    engine core, which binds nothing); None where that cannot be read or nothing is left over.
    """
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        mine = os.sched_getaffinity(0)
        allowed = os.sched_getaffinity(os.getppid())
    except OSError:
        return None
    spare = allowed - mine
    return (mine, spare) if spare else None


def use_cpus(cpus: set[int]) -> None:
    """Bind the calling thread (and the threads it starts from now on) to ``cpus``."""
    os.sched_setaffinity(0, cpus)
