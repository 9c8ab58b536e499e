"""How long the cache's threads wait for the GIL inside vLLM's worker process.

The cache's I/O (storage reads and writes, checksums, copies into and out of vLLM's blocks) runs in
threads of vLLM's worker, beside vLLM's own thread, which runs the model's Python between its torch
calls. Each of our calls that releases the GIL (a socket send or receive, a checksum of a page, a
tensor copy) has to take it back when it returns; with vLLM's thread running Python, CPython makes
the waiter wait the whole switch interval (5 ms by default) before it asks for the GIL. A page's
transfer has several such calls. ``benchmarks/gil_wait.py``, a 5.6 MiB page beside a thread running
Python: a loopback socket transfer 12.9 ms at 5 ms (1.7 ms alone), 4.6 ms at 0.5 ms; its checksum
2.8 ms against 0.14 ms alone, 0.3 ms at 0.5 ms; the Python thread's own rate the same within noise
(it gives the GIL up once per wait either way: the interval only sets how late). The worker
shortens the interval before the cache starts (``gil_switch_interval_s`` in the connector's extra
config), never lengthens one set shorter, and puts the old one back when the cache closes (in
vLLM's single-process mode the interpreter is the user's).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DEFAULT_SWITCH_INTERVAL_S", "shortened_switch_interval"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

DEFAULT_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def shortened_switch_interval(seconds: float | None) -> Iterator[float]:
    """The interpreter's switch interval set to ``seconds`` while the block runs, if that is shorter
    than the current one (``None`` or 0: left as it is); yields the interval in force. On the way
    out the previous interval comes back, unless someone has changed it since (theirs is kept)."""
    current = sys.getswitchinterval()
    if not seconds or seconds >= current:
        yield current
        return
    sys.setswitchinterval(seconds)
    ours = sys.getswitchinterval()
    log.info("hicache: the interpreter's GIL switch interval is %.2f ms (was %.2f ms): the cache's I/O threads "
             "take the GIL back sooner beside vLLM's thread", seconds * 1e3, current * 1e3)
    try:
        yield ours
    finally:
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(current)
