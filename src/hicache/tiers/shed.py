"""Sliding layers leave the host first: a host page may give back the memory of its sliding layers.

A page of a sliding-window hybrid (Gemma 3: five of every six layers slide over 512 tokens) is
needed whole only within a window before some prefix end; everywhere else its full-attention
layers are all a continuation reads. A *compact* host pool lets such a page drop its sliding
layers (it becomes *thin*: ``TreeNode.thin``) and hands their memory back to the OS with
``madvise(MADV_DONTNEED)``, so the same bytes hold up to ``page_bytes / full-layer bytes`` more
pages before anything is evicted.

* ``anonymous_buffer``: the pool's memory as a private anonymous mapping reserved lazily
  (``MAP_NORESERVE``): the pool has slots for that many thin pages, while what it may keep resident
  stays its capacity. ``MADV_DONTNEED`` on it makes pages read as zeros, which is what a thin page's
  sliding layers are.
* ``SlidingRanges``: where a page's sliding layers lie in the buffer, and how many of their bytes
  whole OS pages cover (the credit: only those are given back; partial OS pages are zeroed).
* ``ByteBudgetAllocator``: the page allocator of such a pool. A whole page costs ``page_bytes``, a
  shed one ``page_bytes`` less its credit; ``num_free`` counts the whole pages the budget can still
  take, so every caller that allocates, evicts or waits for room keeps working unchanged.

Only an unpinned CPU pool on Linux can shed (pinned memory is locked; ``compact_possible``).
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..errors import CapacityError
from .base import KVGeometry, PageAllocator

__all__ = ["ByteBudgetAllocator", "SlidingRanges", "anonymous_buffer", "compact_possible"]

_OS_PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 lacks the name


def compact_possible() -> bool:
    """Whether this platform can give a buffer's pages back (Linux anonymous mappings)."""
    return sys.platform.startswith("linux") and hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")


def anonymous_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``nbytes`` of private anonymous memory, reserved as it is touched, as a uint8 tensor (which
    keeps the mapping alive)."""
    size = max(nbytes, 1)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)


def _runs(layers: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted layer indices as ``(first, end)`` runs of consecutive layers."""
    out: list[tuple[int, int]] = []
    for layer in sorted(layers):
        if out and out[-1][1] == layer:
            out[-1] = (out[-1][0], layer + 1)
        else:
            out.append((layer, layer + 1))
    return out


class SlidingRanges:
    """The byte ranges of each page's sliding layers in a host buffer of ``layout``."""

    def __init__(self, geometry: KVGeometry, sliding_layers: Sequence[int], num_pages: int, layout: str) -> None:
        self.geometry = geometry
        self.num_pages = num_pages
        self.layout = layout
        self.piece = geometry.page_elems * geometry.dtype.itemsize  # one component of one layer of one page
        self.runs = _runs(sliding_layers)

    def ranges(self, page: int) -> list[tuple[int, int]]:
        """``[start, end)`` byte ranges of ``page``'s sliding layers, ascending."""
        g, piece = self.geometry, self.piece
        L, C = g.num_layers, g.components
        out = []
        for c in range(C):
            for first, end in self.runs:
                if self.layout == "page_first":
                    start = ((page * C + c) * L + first) * piece
                    out.append((start, start + (end - first) * piece))
                else:  # layer_first: [C, L, pages, ...]
                    for layer in range(first, end):
                        start = ((c * L + layer) * self.num_pages + page) * piece
                        out.append((start, start + piece))
        out.sort()
        return out

    @staticmethod
    def _inner(start: int, end: int) -> tuple[int, int]:
        """The whole OS pages within ``[start, end)``."""
        lo = -(-start // _OS_PAGE) * _OS_PAGE
        hi = end // _OS_PAGE * _OS_PAGE
        return (lo, hi) if hi > lo else (start, start)

    def credit(self, page: int) -> int:
        """Bytes of ``page``'s sliding layers that shedding it gives back (whole OS pages only)."""
        return sum(hi - lo for lo, hi in (self._inner(a, b) for a, b in self.ranges(page)))

    def min_credit(self) -> int:
        """The least any page gives back (pages differ only in how their ranges align)."""
        period = max(1, _OS_PAGE // max(1, np.gcd(self.piece, _OS_PAGE)))
        return min((self.credit(p) for p in range(min(self.num_pages, period + 1))), default=0)

    def release(self, mapping: mmap.mmap, raw: np.ndarray, pages: Sequence[int]) -> None:
        """Make the sliding layers of ``pages`` zeros, giving whole OS pages back to the OS."""
        spans = sorted(r for p in pages for r in self.ranges(p))
        merged: list[list[int]] = []
        for a, b in spans:
            if merged and merged[-1][1] == a:
                merged[-1][1] = b
            else:
                merged.append([a, b])
        for a, b in merged:
            lo, hi = self._inner(a, b)
            if hi > lo:
                mapping.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            raw[a:lo] = 0
            raw[max(hi, a):b] = 0


class ByteBudgetAllocator(PageAllocator):
    """Page slots under a byte budget: a whole page costs ``page_bytes``, a shed page that less its
    credit. ``num_free``: the whole pages that can be allocated now (free slots and budget both)."""

    def __init__(self, num_pages: int, budget_bytes: int, page_bytes: int) -> None:
        super().__init__(num_pages)
        self.budget_bytes = budget_bytes
        self.page_bytes = page_bytes
        self.spent_bytes = 0
        self._credit: dict[int, int] = {}  # shed page -> bytes it gave back

    @property
    def num_free(self) -> int:
        room = max(0, self.budget_bytes - self.spent_bytes) // self.page_bytes
        return min(super().num_free, room)

    @property
    def shed_pages(self) -> int:
        return len(self._credit)

    @property
    def shed_bytes(self) -> int:
        return self.num_used * self.page_bytes - self.spent_bytes

    def allocate(self, n: int) -> list[int]:
        if 0 <= n and n > self.num_free:
            raise CapacityError(f"{n} pages requested, {self.num_free} fit in the host's budget")
        pages = super().allocate(n)
        self.spent_bytes += len(pages) * self.page_bytes
        return pages

    def free(self, pages: Sequence[int]) -> None:
        super().free(pages)  # validates first: nothing changes on a bad free
        credit = self._credit
        self.spent_bytes -= len(pages) * self.page_bytes - sum(credit.pop(p, 0) for p in pages)

    def is_shed(self, page: int) -> bool:
        return page in self._credit

    def shed(self, credits: dict[int, int]) -> None:
        """Pages that gave back ``credits`` bytes each (allocated, not shed already)."""
        for page, credit in credits.items():
            if not self.is_allocated(page):
                raise AssertionError(f"shed of free page {page}")
            if page not in self._credit:
                self._credit[page] = credit
                self.spent_bytes -= credit

    def restore(self, pages: Iterable[int]) -> None:
        """Shed pages written whole again: they cost their full size (the budget may be overdrawn
        until the next eviction; ``num_free`` stays 0 meanwhile)."""
        for page in pages:
            self.spent_bytes += self._credit.pop(page, 0)
