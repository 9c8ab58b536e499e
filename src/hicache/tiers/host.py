"""The host pool: a larger CPU buffer holding copies of device pages and pages evicted from it.

Two layouts: ``page_first`` ``[pages, C, L, page_size, H, D]`` (a page is contiguous: the shape that
storage tiers read and write in one piece) and ``layer_first`` ``[C, L, pages, page_size, H, D]``
(same as the device, cheapest per-layer load-back). Pinned when CUDA is present so that copies to
the device can be asynchronous. With ``prefault`` its pages are faulted in by a background thread
from open on (``prefault.py``), for engines that write fresh host pages on their critical path.
"""

from __future__ import annotations

import threading
from typing import Literal

import torch

from .base import KVGeometry, MemoryTier
from .prefault import populate_in_background

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
    ) -> None:
        super().__init__(geometry, capacity_bytes, torch.device("cpu"))
        self.layout = layout
        self.prefault = prefault
        self.prefault_thread: threading.Thread | None = None
        self._stop_prefault = threading.Event()
        # Pinning only pays when pages travel to a CUDA device tier (asynchronous copies).
        auto = device_tier is not None and device_tier.type == "cuda"
        self.pin_memory = auto if pin_memory == "auto" else bool(pin_memory)

    def _allocate_buffer(self) -> torch.Tensor:
        g = self.geometry
        if self.layout == "page_first":
            shape = (self.num_pages, g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)
        else:
            shape = (g.components, g.num_layers, self.num_pages, g.page_size, g.num_kv_heads, g.head_dim)
        # torch.empty: untouched host pages cost nothing until first written.
        return torch.empty(shape, dtype=g.dtype, pin_memory=self.pin_memory)

    async def open(self) -> None:
        fresh = self._buffer is None
        await super().open()
        if fresh and self.prefault and not self.pin_memory:  # pinned memory is resident already
            self._stop_prefault.clear()
            self.prefault_thread = populate_in_background(self.buffer, self._stop_prefault, self.name)

    async def aclose(self) -> None:
        self._stop_prefault.set()
        await super().aclose()

    def page_major(self) -> torch.Tensor:
        g = self.geometry
        if self.layout == "page_first":
            return self.buffer.view(self.num_pages, g.components, g.num_layers, g.page_elems)
        return self.buffer.view(g.components, g.num_layers, self.num_pages, g.page_elems).permute(2, 0, 1, 3)
