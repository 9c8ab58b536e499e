"""``ComputeGate``: one model step at a time, waiting prefills before waiting decode steps.

A CPU (or one GPU stream) runs one forward at a time; queueing them here, rather than in a
thread pool, lets the order be chosen. Prefill first is what SGLang's scheduler does by default:
a new request's first token does not wait behind every running request's next decode step.

The gate also knows when a prefill computes: ``wait_no_prefill()`` is what the cache's background
copies and storage writes await (``CachedCausalLM`` hands it to the cache), so on a machine whose
cores the model needs they run between prefills instead of slowing them down.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

__all__ = ["ComputeGate"]


class ComputeGate:
    """An async lock with priorities (lower first; FIFO within one priority)."""

    PREFILL = 0
    DECODE = 1

    def __init__(self) -> None:
        self._held = False
        self._holder: int | None = None  # the priority of the step holding the gate
        self._queue: list[tuple[int, int, anyio.Event]] = []
        self._order = itertools.count()
        self._no_prefill_waiters: list[anyio.Event] = []

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def prefill_running(self) -> bool:
        return self._holder == self.PREFILL

    async def wait_no_prefill(self) -> None:
        """Return once no prefill holds the gate (at once when none does)."""
        while self._holder == self.PREFILL:
            event = anyio.Event()
            self._no_prefill_waiters.append(event)
            try:
                await event.wait()
            finally:
                if event in self._no_prefill_waiters:
                    self._no_prefill_waiters.remove(event)

    def _set_holder(self, priority: int | None) -> None:
        self._holder = priority
        if priority != self.PREFILL and self._no_prefill_waiters:
            waiters, self._no_prefill_waiters = self._no_prefill_waiters, []
            for event in waiters:
                event.set()

    @asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        """Hold the gate for one step; ``priority`` is ``PREFILL`` or ``DECODE``."""
        if self._held:
            entry = (priority, next(self._order), anyio.Event())
            heapq.heappush(self._queue, entry)
            try:
                await entry[2].wait()
            except BaseException:
                if entry[2].is_set():
                    self._release()  # handed to us as we were cancelled: hand it on
                else:
                    self._queue.remove(entry)
                    heapq.heapify(self._queue)
                raise
        else:
            self._held = True
            self._set_holder(priority)
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        if self._queue:
            priority, _, event = heapq.heappop(self._queue)
            self._set_holder(priority)
            event.set()  # stays held: handed over to the next in line
        else:
            self._held = False
            self._set_holder(None)
