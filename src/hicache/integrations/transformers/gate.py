"""``ComputeGate``: one model step at a time, waiting prefills before waiting decode steps.

A CPU (or one GPU stream) runs one forward at a time; queueing them here, rather than in a
thread pool, lets the order be chosen. Prefill first is what SGLang's scheduler does by default:
a new request's first token does not wait behind every running request's next decode step.
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
        self._queue: list[tuple[int, int, anyio.Event]] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._queue)

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
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        if self._queue:
            heapq.heappop(self._queue)[2].set()  # stays held: handed over to the next in line
        else:
            self._held = False
