"""What the GIL switch interval costs the cache's I/O threads beside an engine thread running Python.

Usage::

    python benchmarks/gil_wait.py [--page-mib 5.6] [--calls 40] [--intervals 5,1,0.5,0.2,0.1] [--engine torch]

Inside vLLM's worker the cache's threads share the interpreter with vLLM's thread, which runs the
model's Python between its torch calls. Every call of ours that releases the GIL has to take it
back when it returns, and CPython makes that thread wait out the switch interval before it asks
(``integrations/vllm/gil.py``). Timed per call on one page of ``--page-mib`` MiB, from a thread on
one core, alone ("quiet") and beside a thread on the other core that runs Python in a loop
(``--engine python``, the default: an engine's input preparation, sampling and scheduling) or
small torch ops with some Python between them (``--engine torch``: each op lets the GIL go, so
the waits are shorter), at each switch interval (ms):

* ``xxh3``: the page's checksum (what every storage read and write computes);
* ``copy``: ``torch.Tensor.copy_`` of the page (a copy into or out of vLLM's blocks);
* ``socket``: the page sent and received back over a loopback socket pair (a storage transfer).

Each figure is also given as a ratio to the same call quiet, in the same run, and the engine
thread's loop rate beside each interval (its cost: the interval must not slow it). Set
``OMP_WAIT_POLICY=PASSIVE`` (the default here) on 2 shared cores.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import xxhash  # noqa: E402


def _calls(page: torch.Tensor, dst: torch.Tensor, pair: tuple[socket.socket, socket.socket]):
    view = memoryview(page.numpy()).cast("B")
    back = memoryview(dst.numpy()).cast("B")
    a, b = pair

    def xxh3() -> None:
        x = xxhash.xxh3_64()
        x.update(view)
        x.intdigest()

    def copy() -> None:
        dst.copy_(page)

    def sock() -> None:
        sender = threading.Thread(target=a.sendall, args=(view,))
        sender.start()
        got = 0
        while got < len(back):
            got += b.recv_into(back[got:], len(back) - got)
        sender.join()

    return {"xxh3": xxh3, "copy": copy, "socket": sock}


def _time(fn, calls: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


class _Engine:
    """A thread on its own core running Python (and, ``torch``, small torch ops), as an engine's step does."""

    def __init__(self, cpu: int | None, kind: str) -> None:
        self.loops = 0
        self._kind = kind
        self._stop = threading.Event()
        self._cpu = cpu
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self._cpu is not None:
            os.sched_setaffinity(0, {self._cpu})
        x = torch.randn(64, 64)
        while not self._stop.is_set():
            if self._kind == "torch":
                y = x
                for _ in range(8):
                    y = torch.tanh(y @ x) * 0.5
            sum(range(20_000))  # the Python between an engine's torch calls (input preparation, sampling, scheduling)
            self.loops += 1

    def rate(self, fn, calls: int) -> tuple[float, float]:
        before, started = self.loops, time.perf_counter()
        per_call = _time(fn, calls)
        return per_call, (self.loops - before) / (time.perf_counter() - started)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--page-mib", type=float, default=5.6)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--intervals", default="5,1,0.5,0.2,0.1", help="switch intervals to try, ms")
    ap.add_argument("--engine", choices=["python", "torch"], default="python", help="what the engine thread runs")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    io_cpu, engine_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    if io_cpu is not None:
        os.sched_setaffinity(0, {io_cpu})
    n = int(args.page_mib * 2**20) // 4
    page, dst = torch.rand(n), torch.empty(n)
    pair = socket.socketpair()
    for s in pair:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    calls = _calls(page, dst, pair)
    default = sys.getswitchinterval()
    quiet = {name: _time(fn, args.calls) for name, fn in calls.items()}
    print(f"page {page.numel() * 4 / 2**20:.1f} MiB, {args.calls} calls each; I/O thread on CPU {io_cpu}, "
          f"{args.engine} engine thread on CPU {engine_cpu}; default switch interval {default * 1e3:.1f} ms")
    print(f"{'':>22}" + "".join(f"{name + ' ms':>12}{'x quiet':>9}" for name in calls) + f"{'engine loops/s':>16}")
    print(f"{'quiet':>22}" + "".join(f"{quiet[name] * 1e3:>12.2f}{1.0:>9.2f}" for name in calls) + f"{'-':>16}")
    engine = _Engine(engine_cpu, args.engine)
    try:
        for ms in (float(v) for v in args.intervals.split(",")):
            sys.setswitchinterval(ms / 1e3)
            row, rates = [], []
            for fn in calls.values():
                per_call, rate = engine.rate(fn, args.calls)
                row.append(per_call)
                rates.append(rate)
            label = f"beside engine, {ms:g} ms"
            print(f"{label:>22}" + "".join(f"{t * 1e3:>12.2f}{t / quiet[name]:>9.2f}" for name, t in zip(calls, row))
                  + f"{sum(rates) / len(rates):>16,.0f}")
    finally:
        engine.stop()
        sys.setswitchinterval(default)
        for s in pair:
            s.close()


if __name__ == "__main__":
    main()
