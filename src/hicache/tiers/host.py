"""The host pool: a larger CPU buffer holding copies of device pages and pages evicted from it.

Two layouts: ``page_first`` ``[pages, C, L, page_size, H, D]`` (a page is contiguous: the shape that
storage tiers read and write in one piece) and ``layer_first`` ``[C, L, pages, page_size, H, D]``
(same as the device, cheapest per-layer load-back). Pinned when CUDA is present so that copies to
the device can be asynchronous. With ``prefault`` its pages are faulted in by a background thread
from open on (``prefault.py``), for engines that write fresh host pages on their critical path.
"""

from __future__ import annotations

import logging
import mmap
import threading
from collections.abc import Sequence
from typing import Literal

import torch

from .base import KVGeometry, MemoryTier
from .prefault import populate_in_background
from .shed import ByteBudgetAllocator, SlidingRanges, anonymous_buffer, compact_possible

log = logging.getLogger(__name__)

__all__ = ["HostPool"]


class HostPool(MemoryTier):
    name = "host"

    def __init__(
        self,
        geometry: KVGeometry,
        capacity_bytes: int,
        layout: Literal["page_first", "layer_first"] = "page_first",
        pin_memory: bool | Literal["auto"] = "auto",
        device_tier: torch.device | None = None,
        prefault: bool = False,
        sliding_layers: Sequence[int] = (),
        compact: bool | Literal["auto"] = "auto",
    ) -> None:
        super().__init__(geometry, capacity_bytes, torch.device("cpu"))
        self.layout = layout
        self.prefault = prefault
        self.prefault_thread: threading.Thread | None = None
        self._stop_prefault = threading.Event()
        # Pinning only pays when pages travel to a CUDA device tier (asynchronous copies).
        auto = device_tier is not None and device_tier.type == "cuda"
        self.pin_memory = auto if pin_memory == "auto" else bool(pin_memory)
        self.sliding: SlidingRanges | None = None
        self._mapping: mmap.mmap | None = None
        self._raw = None
        self._compact_setup(tuple(sliding_layers), compact)

    def _compact_setup(self, sliding_layers: tuple[int, ...], compact: bool | Literal["auto"]) -> None:
        """Make the pool compact where asked (``auto``: wherever it can shed)."""
        g = self.geometry
        if compact is False or not sliding_layers or len(sliding_layers) >= g.num_layers or not self.num_pages:
            return
        why = None
        if self.pin_memory:
            why = "its memory is pinned (locked pages cannot be given back)"
        elif not compact_possible():
            why = "this platform cannot give memory back (Linux only)"
        credit = 0
        if why is None:
            probe = SlidingRanges(g, sliding_layers, self.num_pages, self.layout)
            credit = probe.min_credit()
            if credit <= 0:
                why = "a page's sliding layers cover no whole 4 KiB memory page"
        if why is not None:
            if compact is True:
                log.warning("host tier: compact requested but not possible: %s; pages stay whole", why)
            return
        slots = self.capacity_bytes // (g.page_bytes - credit)
        self.num_pages = slots
        self.sliding = SlidingRanges(g, sliding_layers, slots, self.layout)
        self.allocator = ByteBudgetAllocator(slots, self.capacity_pages * g.page_bytes, g.page_bytes)

    @property
    def compact(self) -> bool:
        """Whether pages can shed their sliding layers here (``shed``)."""
        return self.sliding is not None

    @property
    def shed_pages(self) -> int:
        """Pages held now without their sliding layers' memory."""
        return self.allocator.shed_pages

    def shed(self, pages: Sequence[int]) -> None:
        """Give back the memory of ``pages``' sliding layers (they read as zeros from now on).
        The caller owns the pages and nothing reads or writes them meanwhile. No-op unless compact."""
        allocator = self.allocator
        if self.sliding is None or not isinstance(allocator, ByteBudgetAllocator):
            return
        fresh = [p for p in pages if not allocator.is_shed(p)]
        if not fresh or self._mapping is None:
            return
        self.sliding.release(self._mapping, self._raw, fresh)
        allocator.shed({p: self.sliding.credit(p) for p in fresh})

    def restore(self, pages: Sequence[int]) -> None:
        """``pages`` are being written whole again (their sliding layers filled in)."""
        if isinstance(self.allocator, ByteBudgetAllocator):
            self.allocator.restore(pages)

    def _allocate_buffer(self) -> torch.Tensor:
        g = self.geometry
        if self.layout == "page_first":
            shape = (self.num_pages, g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)
        else:
            shape = (g.components, g.num_layers, self.num_pages, g.page_size, g.num_kv_heads, g.head_dim)
        if self.compact:
            # Slots for every page thin; memory is reserved only as it is touched.
            self._mapping, raw = anonymous_buffer(self.num_pages * g.page_bytes)
            self._raw = raw.numpy()
            return raw.view(g.dtype).view(shape)
        # torch.empty: untouched host pages cost nothing until first written.
        return torch.empty(shape, dtype=g.dtype, pin_memory=self.pin_memory)

    async def open(self) -> None:
        fresh = self._buffer is None
        await super().open()
        if fresh and self.prefault and not self.pin_memory:  # pinned memory is resident already
            self._stop_prefault.clear()
            # A compact pool has more slots than its capacity holds: fault in the capacity's worth
            # (the allocator hands out the lowest pages first).
            warm = self.buffer.view(-1)[: self.capacity_pages * self.geometry.page_bytes // self.geometry.dtype.itemsize]
            self.prefault_thread = populate_in_background(warm, self._stop_prefault, self.name)

    async def aclose(self) -> None:
        self._stop_prefault.set()
        self._raw = None
        self._mapping = None  # unmapped once the last view of it is gone
        await super().aclose()

    def page_major(self) -> torch.Tensor:
        g = self.geometry
        if self.layout == "page_first":
            return self.buffer.view(self.num_pages, g.components, g.num_layers, g.page_elems)
        return self.buffer.view(g.components, g.num_layers, self.num_pages, g.page_elems).permute(2, 0, 1, 3)
