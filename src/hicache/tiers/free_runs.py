"""Free pages as runs of consecutive indices, indexed so that choosing and returning pages costs
O(log n) in the pool size (plus the pages themselves), never a scan of the pool.

The kernel io backend pays per run of consecutive pages, not per page, so the allocator hands out
as few runs as it can: the smallest free run that holds the whole request (best fit, lowest start
among equals), else the longest runs first (lowest start among equals), the last one cut short.

Structures, all updated together:

* ``_free``: one byte per page (1: free), for exact double-free checks in O(1) a page;
* ``_run_at`` (start -> length) and ``_run_to`` (end -> start): runs found from either side, so a
  freed run merges with its neighbours in O(1);
* ``_lengths``: the distinct run lengths, sorted. There are at most ~sqrt(2 * pages) of them
  (distinct lengths sum to at most the pool), so ``bisect`` finds the best fit and ``insort`` stays
  cheap even at 10^6 pages;
* ``_by_length``: per length, the starts of its runs (a set) with a heap for the lowest start;
  heap entries of runs that changed since are dropped lazily, and the heap is rebuilt when stale
  entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Iterable

__all__ = ["FreeRuns"]


class _Starts:
    """The starts of the free runs of one length; ``lowest()`` in O(log n) amortized."""

    __slots__ = ("members", "heap")

    def __init__(self) -> None:
        self.members: set[int] = set()
        self.heap: list[int] = []

    def add(self, start: int) -> None:
        self.members.add(start)
        heapq.heappush(self.heap, start)

    def discard(self, start: int) -> None:
        self.members.discard(start)
        if len(self.heap) > 2 * len(self.members) + 16:
            self.heap = list(self.members)
            heapq.heapify(self.heap)

    def lowest(self) -> int:
        heap, members = self.heap, self.members
        while heap[0] not in members:
            heapq.heappop(heap)
        return heap[0]


class FreeRuns:
    """The free pages of a pool of ``num_pages`` (all free at first), as runs."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.num_free = num_pages
        self._free = bytearray(b"\x01") * num_pages
        self._run_at: dict[int, int] = {}
        self._run_to: dict[int, int] = {}
        self._lengths: list[int] = []
        self._by_length: dict[int, _Starts] = {}
        if num_pages:
            self._add(0, num_pages)

    # -- runs -----------------------------------------------------------------------------------

    def _add(self, start: int, length: int) -> None:
        self._run_at[start] = length
        self._run_to[start + length] = start
        starts = self._by_length.get(length)
        if starts is None:
            starts = self._by_length[length] = _Starts()
            insort(self._lengths, length)
        starts.add(start)

    def _remove(self, start: int) -> int:
        length = self._run_at.pop(start)
        del self._run_to[start + length]
        starts = self._by_length[length]
        starts.discard(start)
        if not starts.members:
            del self._by_length[length]
            del self._lengths[bisect_left(self._lengths, length)]
        return length

    def runs(self) -> list[tuple[int, int]]:
        """Every free run as ``(start, length)``, by start (for tests and diagnostics)."""
        return sorted(self._run_at.items())

    # -- pages ----------------------------------------------------------------------------------

    def is_free(self, page: int) -> bool:
        return bool(self._free[page])

    def take(self, n: int) -> list[int]:
        """``n`` free pages (``0 < n <= num_free``, checked by the caller), sorted, in few runs."""
        lengths = self._lengths
        i = bisect_left(lengths, n)
        if i < len(lengths):  # best fit: the smallest run that holds all n
            length = lengths[i]
            start = self._by_length[length].lowest()
            self._remove(start)
            if length > n:
                self._add(start + n, length - n)
            self._free[start : start + n] = bytes(n)
            self.num_free -= n
            return list(range(start, start + n))
        out: list[int] = []
        left = n
        while left:  # no run holds n: the longest runs first
            length = lengths[-1]
            start = self._by_length[length].lowest()
            self._remove(start)
            part = min(left, length)
            if part < length:
                self._add(start + part, length - part)
            self._free[start : start + part] = bytes(part)
            out.extend(range(start, start + part))
            left -= part
        self.num_free -= n
        out.sort()
        return out

    def give(self, pages: Iterable[int]) -> None:
        """Return allocated ``pages`` (distinct, checked by the caller); merges neighbouring runs."""
        ordered = sorted(pages)
        n = len(ordered)
        i = 0
        while i < n:
            j = i + 1
            while j < n and ordered[j] == ordered[j - 1] + 1:
                j += 1
            self._give_run(ordered[i], ordered[j - 1] + 1)
            i = j
        self.num_free += n

    def _give_run(self, start: int, end: int) -> None:
        self._free[start:end] = b"\x01" * (end - start)
        before = self._run_to.get(start)
        if before is not None:
            self._remove(before)
            start = before
        after = self._run_at.get(end)
        if after is not None:
            self._remove(end)
            end += after
        self._add(start, end - start)
