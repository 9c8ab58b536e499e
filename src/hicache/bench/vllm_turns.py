"""``hicache bench vllm --interleave``: the configurations' processes take turns, request by request.

One after another, two configurations meet different minutes of a shared machine, and on these
VMs the same vLLM process runs the same trace 5-10% faster or slower from one minute to the next:
as much as the 1.05x the one-request target allows. Here every configuration's process is started
at once (booted together, each with its own engine and cache and a copy of the trace), and the
parent grants turns: configuration ``A`` serves request ``k``, then ``B`` serves its request
``k``, ..., the order reversed every round (``A B C``, ``C B A``, ...), so each request of each
configuration meets the same minute of the machine and none is favoured by going first.

A turn is one request, from its arrival to its last token, then the configuration's background
work to its end (the connector's commits and storage writes: ``wait_idle``), so none of it runs
during another configuration's request. Its length is reported (``drain``): run alone, that work
would overlap the decode steps and the gap before the next request. While not its turn a process
is idle: vLLM's engine is stepped only by its driver, and its OpenMP threads sleep
(``OMP_WAIT_POLICY=PASSIVE``). One request in flight only (``--max-parallel 1``).

The protocol is a line per message over two pipes a worker: ``ready`` (booted and warmed up),
then per request ``go`` (parent) and ``done`` (worker). Every wait is bounded, and a worker that
exits or stalls ends the run (``SystemExit`` naming it), and the others are killed.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from .repeats import run_order

__all__ = ["TurnPipe", "run_in_turns", "turn_order"]

BOOT_TIMEOUT_S = 900.0
TURN_TIMEOUT_S = 900.0
EXIT_TIMEOUT_S = 300.0


class TurnPipe:
    """A worker's end: wait for ``go`` before each request, say ``done`` after it."""

    def __init__(self, go_fd: int, done_fd: int) -> None:
        self._go: IO[str] = os.fdopen(go_fd, "r")
        self._done: IO[str] = os.fdopen(done_fd, "w", buffering=1)
        self.busy_s = 0.0  # time holding turns: this configuration's own share of the run
        self.drain_s: list[float] = []
        self._granted: float | None = None

    @classmethod
    def from_spec(cls, turns: dict[str, int] | None) -> TurnPipe | None:
        return None if turns is None else cls(turns["go_fd"], turns["done_fd"])

    def ready(self) -> None:
        self._done.write("ready\n")

    def acquire(self) -> None:
        line = self._go.readline()
        if line != "go\n":
            raise SystemExit(f"expected 'go' from the benchmark, got {line!r}")
        self._granted = time.perf_counter()

    def release(self, drain: Callable[[], None] | None = None) -> None:
        if drain is not None:
            started = time.perf_counter()
            drain()
            self.drain_s.append(time.perf_counter() - started)
        if self._granted is not None:
            self.busy_s += time.perf_counter() - self._granted
            self._granted = None
        self._done.write("done\n")


def turn_order(names: list[str], turns: int) -> list[str]:
    """Every turn in order: ``names`` ``turns`` times, reversed every other round (as ``--repeat``
    orders its repeats: ``repeats.run_order``)."""
    return [name for order in run_order(names, turns) for name in order]


class _Worker:
    """The parent's handle on one configuration's process."""

    def __init__(self, name: str, spec: dict[str, Any], env: dict[str, str], module: str) -> None:
        self.name = name
        go_r, self._go_w = os.pipe()
        self._done_r, done_w = os.pipe()
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            self.out_path = f.name
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, self.out_path], stdin=subprocess.PIPE, text=True, env=env,
                pass_fds=(go_r, done_w), start_new_session=True,  # its vLLM children go with it
            )
        except BaseException:
            for fd in (self._go_w, self._done_r):
                os.close(fd)
            os.unlink(self.out_path)
            raise
        finally:
            os.close(go_r)
            os.close(done_w)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**spec, "turns": {"go_fd": go_r, "done_fd": done_w}}))
        self.proc.stdin.close()
        self._buffer = b""

    def send_go(self) -> None:
        try:
            os.write(self._go_w, b"go\n")
        except BrokenPipeError:
            raise SystemExit(f"configuration {self.name} exited (status {self.proc.poll()})") from None

    def expect(self, word: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"configuration {self.name} did not say {word!r} within {timeout_s:.0f} s")
            readable, _, _ = select.select([self._done_r], [], [], min(left, 1.0))
            if readable:
                chunk = os.read(self._done_r, 64)
                if not chunk:
                    raise SystemExit(f"configuration {self.name} exited (status {self.proc.wait()})")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        if line.decode(errors="replace") != word:
            raise SystemExit(f"configuration {self.name} said {line!r}, expected {word!r}")

    def result(self, timeout_s: float) -> dict[str, Any]:
        try:
            status = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"configuration {self.name} did not exit within {timeout_s:.0f} s") from None
        if status != 0:
            raise SystemExit(f"configuration {self.name} failed (exit status {status})")
        return json.loads(Path(self.out_path).read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for fd in (self._go_w, self._done_r):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            os.unlink(self.out_path)
        except FileNotFoundError:
            pass


def run_in_turns(specs: list[dict[str, Any]], requests: int, env_of: Callable[[dict[str, Any]], dict[str, str]], *,
                 module: str = "hicache.bench.vllm_worker", progress: bool = True) -> dict[str, dict[str, Any]]:
    """Start every spec's process at once, grant ``requests`` turns to each, return their results."""
    workers: dict[str, _Worker] = {}
    bar = None
    try:
        for s in specs:  # inside the try: a failed start closes the ones started before it
            workers[s["configuration"]] = _Worker(s["configuration"], s, env_of(s), module)
        for w in workers.values():
            w.expect("ready", BOOT_TIMEOUT_S)
        order = turn_order(list(workers), requests)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(order), desc="  turns", unit="req", file=sys.stderr)
        for name in order:
            workers[name].send_go()
            workers[name].expect("done", TURN_TIMEOUT_S)
            if bar is not None:
                bar.update(1)
        return {name: {**w.result(EXIT_TIMEOUT_S), "interleaved_with": list(workers)} for name, w in workers.items()}
    finally:
        if bar is not None:
            bar.close()
        for w in workers.values():
            w.close()
