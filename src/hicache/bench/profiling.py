"""What a benchmark run records about the machine and where its CPU time went.

* ``cpu_pressure()``: ``/proc/pressure/cpu`` (the share of time runnable tasks waited for a CPU),
  so every figure carries how busy the shared machine was.
* ``process_times()``: this process's user and system CPU seconds, page faults, context switches.
* ``thread_times()``: CPU seconds per live thread, named after its Python thread where it has one
  (torch's OpenMP threads have none), to see which threads compete with the model.
* ``torch_profile(on)``: ``torch.profiler`` over a block; ``result`` holds the top operators.
* ``stage_summary(records)``: the per-stage timers of the requests, as means and shares of TTFT.
* ``ActivityTrace`` / ``install_trace``: wall and CPU time of the model's forwards and of the
  cache's copies, checksums, file reads, writes and fsyncs, and how much of each overlapped a
  prefill (``--profile``).
"""

from __future__ import annotations

import os
import resource
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = [
    "ActivityTrace", "TorchProfile", "cpu_pressure", "install_trace", "process_times", "stage_summary", "thread_times",
    "torch_profile",
]


def cpu_pressure() -> dict[str, float] | None:
    """``some`` averages of ``/proc/pressure/cpu`` in percent (``None`` where the kernel has no PSI)."""
    try:
        with open("/proc/pressure/cpu") as f:
            line = f.readline().split()
    except OSError:
        return None
    if not line or line[0] != "some":
        return None
    return {k: float(v) for k, v in (item.split("=") for item in line[1:]) if k.startswith("avg")}


def process_times() -> dict[str, float]:
    """CPU seconds, page faults (minor: a page mapped or zeroed; major: read from disk) and context
    switches (voluntary: waits; involuntary: preempted) of this process so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": r.ru_utime, "system_s": r.ru_stime, "minor_faults": r.ru_minflt, "major_faults": r.ru_majflt,
            "voluntary_switches": r.ru_nvcsw, "involuntary_switches": r.ru_nivcsw}


def thread_times() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by name (unnamed threads summed)."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        name = names.get(int(tid), "native (torch/OpenMP or C++)")
        if name.startswith("AnyIO worker thread"):
            name = "anyio worker threads"
        out[name] = out.get(name, 0.0) + cpu
    return out


class TorchProfile:
    def __init__(self) -> None:
        self.result: dict[str, Any] | None = None


@contextmanager
def torch_profile(on: bool, top: int = 25) -> Iterator[TorchProfile]:
    """Profile the block with ``torch.profiler`` (CPU) when ``on``; ``.result`` has the top operators."""
    holder = TorchProfile()
    if not on:
        yield holder
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield holder
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    total = sum(e.self_cpu_time_total for e in events) or 1
    holder.result = {
        "self_cpu_total_s": total / 1e6,
        "top": [
            {"op": e.key, "calls": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6,
             "share": e.self_cpu_time_total / total}
            for e in rows
        ],
    }


def stage_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean seconds per request of each stage, and the prefill-side stages as shares of mean TTFT."""
    if not records:
        return {}
    names: list[str] = []
    for r in records:
        for k in r.get("stages", {}):
            if k not in names:
                names.append(k)
    n = len(records)
    mean = {k: sum(r.get("stages", {}).get(k, 0.0) for r in records) / n for k in names}
    layers = max((len(r.get("restore_wait_by_layer", [])) for r in records), default=0)
    by_layer = [sum(r["restore_wait_by_layer"][i] for r in records if len(r.get("restore_wait_by_layer", [])) > i) / n
                for i in range(layers)]
    ttft = sum(r["ttft_s"] for r in records) / n
    queue = sum(r["queue_s"] for r in records) / n
    ttft_parts = ["lookup", "retrieve", "prefill_gate", "prefill_hop", "restore_wait", "restore_copy", "prefill_compute"]
    explained = queue + sum(mean.get(k, 0.0) for k in ttft_parts if k != "lookup")
    return {
        "mean_s": mean,
        "restore_wait_by_layer_mean_s": by_layer,
        "ttft_mean_s": ttft,
        "queue_mean_s": queue,
        # TTFT = queueing (lookup included) + the prefill-side stages + what no timer covers
        "ttft_unexplained_s": ttft - explained,
    }


class ActivityTrace:
    """Which work ran when, to see what overlaps a prefill (``--profile`` only).

    ``wrap(owner, name, label)`` replaces ``owner.name`` (a function called in a worker thread) by a
    timed one: each call's wall interval and the CPU seconds of its thread. ``forward`` calls are
    split into prefills (more than one token) and decode steps. ``summary()`` gives, per label, the
    calls, wall and CPU seconds, and the wall seconds that overlapped a prefill forward.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.intervals: dict[str, list[tuple[float, float, float]]] = {}  # label -> (start, end, thread cpu)

    def record(self, label: str, start: float, end: float, cpu: float) -> None:
        with self._lock:
            self.intervals.setdefault(label, []).append((start, end, cpu))

    def wrap(self, owner: Any, name: str, label: str | Any) -> None:
        import functools
        import time

        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                which = label(*args, **kwargs) if callable(label) else label
                self.record(which, t0, time.perf_counter(), time.thread_time() - c0)

        setattr(owner, name, timed)

    def summary(self) -> dict[str, Any]:
        prefills = sorted((a, b) for a, b, _ in self.intervals.get("prefill forward", []))
        out: dict[str, Any] = {}
        for label, spans in sorted(self.intervals.items()):
            overlap = 0.0
            if label != "prefill forward":
                for a, b, _ in spans:
                    overlap += sum(max(0.0, min(b, pb) - max(a, pa)) for pa, pb in prefills if pa < b and pb > a)
            out[label] = {
                "calls": len(spans),
                "wall_s": sum(b - a for a, b, _ in spans),
                "thread_cpu_s": sum(c for _, _, c in spans),
                "wall_during_prefill_s": overlap,
            }
        return out


def install_trace(trace: ActivityTrace) -> None:
    """Time the model's forwards and the cache's background work in this process."""
    import os as _os

    from ..integrations.transformers import causal_lm
    from ..io import transfer
    from ..tiers.storage import file as file_backend
    from ..tiers.storage import tier

    def forward_label(self: Any, ids: list[int], kv: Any) -> str:
        return "prefill forward" if len(ids) > 1 else "decode forward"

    trace.wrap(causal_lm.CachedCausalLM, "forward", forward_label)
    trace.wrap(causal_lm.Sequence, "_restore_layer", "restore copy (compute thread)")
    trace.wrap(causal_lm.Sequence, "_export", "export (compute thread)")
    trace.wrap(transfer.TransferEngine, "device_to_host", "backup/spill copy device->host")
    trace.wrap(transfer.TransferEngine, "host_to_device", "load-back copy host->device")
    trace.wrap(transfer.TransferEngine, "user_to_pool", "store copy into pool pages")
    trace.wrap(tier.StorageTier, "_encode", "storage: encode headers (checksums)")
    trace.wrap(tier.StorageTier, "_verify", "storage: verify read pages")
    trace.wrap(file_backend, "write_pages", "file tier: write page files (incl. fsync)")
    trace.wrap(file_backend, "read_pages", "file tier: read page files")
    trace.wrap(_os, "fsync", "file tier: fsync")
