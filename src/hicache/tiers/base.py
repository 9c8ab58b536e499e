"""The interface every memory tier implements, and the page allocator they share.

A memory tier is a paged KV buffer plus an allocator. The data plane never sees a layout: it asks a
tier for *page-major views*, ``page_major()`` of shape ``[pages, C, L, E]`` and ``layer_view(l)`` of
shape ``[pages, C, E]`` (``C`` = 2 for K and V, 1 for MLA; ``E`` = page_size * heads * head_dim),
which may be strided views over the tier's real layout. Copies between any two tiers are then one
operation over two such views, whatever the layouts.

Tiers are async components (``async with tier``) so that those which must connect or allocate
lazily (the storage tiers of a later issue) share the lifecycle; constructors never allocate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CacheClosedError, CapacityError
from .free_runs import FreeRuns

__all__ = ["KVGeometry", "PageAllocator", "MemoryTier"]


@dataclass(frozen=True)
class KVGeometry:
    """Shape and dtype of one page of KV."""

    components: int  # 2 (K, V) or 1 (MLA latent)
    num_layers: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def page_elems(self) -> int:
        """Elements of one component of one layer of one page (``E``)."""
        return self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.components * self.num_layers * self.page_elems * self.dtype.itemsize

    def pages_for(self, capacity_bytes: int) -> int:
        return capacity_bytes // self.page_bytes


class PageAllocator:
    """Free-page bookkeeping with exact accounting: double frees and foreign pages raise.

    Hands out pages in as few runs of consecutive indices as it can (the smallest free run that
    fits, else the longest runs first), because the kernel io backend pays per run, not per page.
    Allocating and freeing cost O(log pool) plus the pages themselves (``free_runs.py``).
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._runs = FreeRuns(num_pages)

    @property
    def num_free(self) -> int:
        return self._runs.num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._runs.num_free

    # Pages held without part of their memory: only a compact host's allocator sheds (shed.py).
    @property
    def shed_pages(self) -> int:
        return 0

    @property
    def shed_bytes(self) -> int:
        return 0

    def is_shed(self, page: int) -> bool:
        return False

    def allocate(self, n: int) -> list[int]:
        """Allocate ``n`` pages, all or nothing; ``CapacityError`` if fewer are free."""
        if n < 0:
            raise ValueError("negative page count")
        if n > self._runs.num_free:
            raise CapacityError(f"{n} pages requested, {self._runs.num_free} free")
        if n == 0:
            return []
        return self._runs.take(n)

    def free(self, pages: Sequence[int]) -> None:
        if not len(pages):
            return
        runs = self._runs
        limit = self.num_pages
        for p in pages:
            if not 0 <= p < limit:
                raise AssertionError(f"free of foreign page {p} (the pool has {limit} pages)")
            if runs.is_free(p):
                raise AssertionError(f"double free of pages {list(pages[:8])}...")
        if len(set(pages)) != len(pages):
            raise AssertionError(f"double free of pages {list(pages[:8])}...")
        runs.give(pages)

    def is_allocated(self, page: int) -> bool:
        return not self._runs.is_free(page)

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as ``(start, length)`` runs, by start."""
        return self._runs.runs()


class MemoryTier(ABC):
    """A paged KV buffer in one kind of memory (device or host)."""

    name: str = "tier"

    def __init__(self, geometry: KVGeometry, capacity_bytes: int, device: torch.device) -> None:
        self.geometry = geometry
        self.device = device
        self.capacity_bytes = capacity_bytes
        self.num_pages = geometry.pages_for(capacity_bytes)
        self.capacity_pages = self.num_pages  # whole pages the capacity holds (a compact host has more slots)
        self.allocator: PageAllocator = PageAllocator(self.num_pages)
        self._buffer: torch.Tensor | None = None

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> MemoryTier:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self._buffer is None:
            self._buffer = self._allocate_buffer()

    async def aclose(self) -> None:
        self._buffer = None

    @abstractmethod
    def _allocate_buffer(self) -> torch.Tensor:
        """Allocate the tier's real buffer in its own layout."""

    @property
    def buffer(self) -> torch.Tensor:
        if self._buffer is None:
            raise CacheClosedError(f"the {self.name} tier is not open: the cache was closed, or never entered")
        return self._buffer

    # -- views for the data plane ---------------------------------------------------------------

    @abstractmethod
    def page_major(self) -> torch.Tensor:
        """View ``[pages, C, L, E]`` over the buffer (may be strided)."""

    def layer_view(self, layer: int) -> torch.Tensor:
        """View ``[pages, C, E]`` of one layer."""
        return self.page_major()[:, :, layer]

    # -- accounting -----------------------------------------------------------------------------

    @property
    def used_pages(self) -> int:
        return self.allocator.num_used

    @property
    def free_pages(self) -> int:
        return self.allocator.num_free

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.used_pages}/{self.num_pages} pages on {self.device}>"
