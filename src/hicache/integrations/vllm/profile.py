"""What the connector's hooks cost vLLM: calls and seconds per hook, on each side.

vLLM calls the connector synchronously on its critical path: the scheduler's lookups (a round trip
over the side channel each), its step plan, and on the worker, per step and per layer, the hooks
that lease, copy and commit. Each hook adds two ``perf_counter`` reads to its call (about 0.1 us),
so the profile is always on; ``hicache bench vllm-overhead`` and the Prometheus metrics
(``hicache_vllm_hook_seconds_total``) read it. Background work (backups to the host tier, storage
writes) runs off the critical path, on the cache's event loop and its I/O threads, and is measured
as CPU time instead (``loop_cpu_seconds``).
"""

from __future__ import annotations

import os
import re
import threading
import time

__all__ = ["HookProfile", "SCHEDULER_HOOKS", "WORKER_HOOKS", "thread_cpu_seconds", "threads_cpu_seconds"]

#: the scheduler's hooks: ``lookup`` (a channel round trip: queued and scheduling-time lookups),
#: ``plan`` (build_connector_meta), ``finish`` (request_finished: the channel's forget message),
#: ``lookup_reused`` (calls only: scheduling-time lookups answered by the queued one, no round trip)
SCHEDULER_HOOKS = ("lookup", "plan", "finish", "lookup_reused")
#: the worker's hooks: ``bind`` (a step's leases, ``load_wait`` excluded), ``load_wait`` (in bind:
#: waiting for pages that only storage held to arrive in the host tier), ``load`` (before each
#: layer's attention: held pages copied into vLLM's blocks), ``save`` (after it: the new pages
#: copied into host pages), ``commit`` (the step's end), ``stats`` (vLLM's connector stats),
#: ``catch_up`` (on the cache's loop, inside a scheduler's lookup: waiting for the steps ended
#: before it to be committed; part of the scheduler's ``lookup`` time, not vLLM's worker's),
#: ``serve_lookup`` (on the loop: a lookup from its message to its reply, ``catch_up`` included; the
#: scheduler's ``lookup`` less this is the channel: framing, the socket, waking the loop's thread)
WORKER_HOOKS = ("bind", "load_wait", "load", "save", "commit", "stats", "catch_up", "serve_lookup")


class HookProfile:
    """Calls and seconds per hook. Its keys are fixed at construction, so a reader in another
    thread (the cache's event loop, exporting metrics) never sees the dict change size."""

    __slots__ = ("calls", "seconds")

    def __init__(self, hooks: tuple[str, ...]) -> None:
        self.calls = dict.fromkeys(hooks, 0)
        self.seconds = dict.fromkeys(hooks, 0.0)

    def add(self, hook: str, seconds: float) -> None:
        self.calls[hook] += 1
        self.seconds[hook] += seconds

    def snapshot(self) -> dict[str, list[float]]:
        """``{hook: [calls, seconds]}`` (plain data: it crosses processes as JSON)."""
        return {hook: [self.calls[hook], self.seconds[hook]] for hook in self.calls}


def thread_cpu_seconds(ident: int | None) -> float | None:
    """CPU seconds a thread of this process has used (``threading.get_ident()``), where the OS says."""
    if ident is None:
        return None
    try:
        if ident == threading.get_ident():
            return time.thread_time()
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError, ProcessLookupError):
        return None


def threads_cpu_seconds() -> dict[str, float]:
    """CPU seconds of this process's live threads, summed by role (Linux; ``{}`` elsewhere).

    A Python thread counts under its name with digits dropped (``hicache loop``: the cache's event
    loop; ``AnyIO worker thread``: its I/O threads; ``MainThread``); threads Python did not start
    (vLLM's OpenMP threads) count as ``other``. Threads that have exited are not counted.
    """
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    by_id = {t.native_id: re.sub(r"\d+", "", t.name) for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        seconds = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        role = by_id.get(int(tid), "other")
        out[role] = out.get(role, 0.0) + seconds
    return out
