"""Received pages copied into vLLM's blocks on vLLM's own thread, in ``get_finished``.

Why there and not in a cache thread: a copy run from the cache's loop in a worker thread needs the
GIL back several times (to start, to build the pages' views, to return, to wake the loop), and in a
vLLM server vLLM's thread holds it most of the time, handing it over only every switch interval
(5 ms): a 24 MB hand-off that copies in 4-8 ms took 35-141 ms that way (``bench pd``). vLLM's thread
holds the GIL already and calls ``get_finished`` every step, also while requests only wait for
transfers: a copy queued for it runs there at once, and its request is reported received in the
same call.

The loop queues one copy per receive with the pages' leases held and waits for it; it releases
them only once the copy has run or was withdrawn. A copy still queued when its request ends is
withdrawn at once (``withdraw``, from the loop's handling of the scheduler's ``forget``, before the
scheduler goes on): vLLM may give the request's blocks to another request in its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio

__all__ = ["CopyIn", "Copy", "CopyQueue"]

log = logging.getLogger("vllm.hicache")

#: ``copy_in(block_ids, first_page, segments)``: copy held pages (``[(tier, pages)]``, from token
#: page ``first_page`` on) into the request's vLLM blocks, every layer (run on vLLM's thread).
CopyIn = Callable[[list[int], int, list[tuple[Any, list[int]]]], None]

_TAKEN_WAIT_S = 10.0  # a cancelled receive waits this long for a copy vLLM's thread is running


@dataclasses.dataclass(eq=False)
class Copy:
    """One receive's copy: its pages from ``spec.first_page`` to ``end_page`` (``segments``) into
    ``spec.block_ids`` (``spec``: the request's ``ReceiveSpec``)."""

    spec: Any
    copy_in: CopyIn
    end_page: int  # the first page not copied
    segments: list[tuple[Any, list[int]]]
    loop: asyncio.AbstractEventLoop
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    state: str = "queued"  # queued -> taken -> done, or queued -> withdrawn
    seconds: float = 0.0
    error: BaseException | None = None

    @property
    def req_id(self) -> str:
        return str(self.spec.req_id)


class CopyQueue:
    """Copies queued by the loop (``post``, ``wait``), run by vLLM's thread (``run``)."""

    def __init__(self, ready: threading.Event) -> None:
        self._lock = threading.Lock()
        self._queued: list[Copy] = []
        self._taken: list[Copy] = []  # being run by vLLM's thread
        self._ready = ready  # wakes a ``get_finished`` that waits for a transfer to end

    @property
    def queued(self) -> int:
        """Copies waiting for vLLM's next ``get_finished``."""
        with self._lock:
            return len(self._queued)

    def post(self, copy: Copy) -> None:
        with self._lock:
            self._queued.append(copy)
        self._ready.set()

    async def wait(self, copy: Copy) -> None:
        """Until vLLM's thread has run ``copy``; cancelled, withdraw it (or, running, let it end)."""
        try:
            await copy.done.wait()
        except BaseException:
            if self._withdraw(lambda c: c is copy) == "taken":
                with anyio.move_on_after(_TAKEN_WAIT_S, shield=True):
                    await copy.done.wait()
                if copy.state != "done":
                    log.error("hicache: the copy of %s's pages did not end within %.0f s of its receive's end",
                              copy.req_id, _TAKEN_WAIT_S)
            raise

    def withdraw(self, req_id: str) -> None:
        """The request ended: its copy, if still queued, never runs."""
        self._withdraw(lambda c: c.req_id == req_id)

    def _withdraw(self, match: Callable[[Copy], bool]) -> str:
        """Withdraw the queued copies ``match`` picks; "taken" if one of them is running now."""
        with self._lock:
            for copy in [c for c in self._queued if match(c)]:
                self._queued.remove(copy)
                copy.state = "withdrawn"
            return "taken" if any(c.state == "taken" for c in self._taken if match(c)) else ""

    def run(self) -> list[Copy]:
        """On vLLM's thread: run every queued copy, in order; a copy that fails is logged, not raised."""
        with self._lock:
            copies, self._queued = self._queued, []
            for copy in copies:
                copy.state = "taken"
            self._taken = copies
        for copy in copies:
            started = time.perf_counter()
            try:
                copy.copy_in(copy.spec.block_ids, copy.spec.first_page, copy.segments)
            except Exception as exc:  # noqa: BLE001 - a failed copy is a failed receive, never vLLM's error
                copy.error = exc
                log.error("hicache: copying the received pages of %s into vLLM's blocks failed: %r; vLLM "
                          "recomputes them", copy.req_id, exc)
            copy.seconds = time.perf_counter() - started
            with self._lock:
                copy.state = "done"
            try:
                copy.loop.call_soon_threadsafe(copy.done.set)
            except RuntimeError:  # the loop has closed: nobody waits for it
                pass
        with self._lock:
            self._taken = []
        return copies
