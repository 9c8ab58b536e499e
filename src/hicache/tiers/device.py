"""The device pool: the KV the engine attends over, layer-first ``[C, L, pages, page_size, H, D]``.

Layer-first keeps each layer's KV contiguous, which is what attention kernels read and what lets
load-back hand over one layer at a time. On CUDA when present, else on the CPU (first-class here).
"""

from __future__ import annotations

import torch

from .base import KVGeometry, MemoryTier

__all__ = ["DevicePool", "resolve_device"]


def resolve_device(setting: str) -> torch.device:
    """``auto`` picks CUDA when available, else CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


class DevicePool(MemoryTier):
    name = "device"

    def __init__(self, geometry: KVGeometry, capacity_bytes: int, device: str = "auto") -> None:
        super().__init__(geometry, capacity_bytes, resolve_device(device))

    def _allocate_buffer(self) -> torch.Tensor:
        g = self.geometry
        return torch.zeros(
            (g.components, g.num_layers, self.num_pages, g.page_size, g.num_kv_heads, g.head_dim),
            dtype=g.dtype,
            device=self.device,
        )

    @property
    def kv(self) -> torch.Tensor:
        """The pool tensor ``[C, L, pages, page_size, H, D]`` (zero-copy access for engines)."""
        return self.buffer

    def page_major(self) -> torch.Tensor:
        g = self.geometry
        return self.buffer.view(g.components, g.num_layers, self.num_pages, g.page_elems).permute(2, 0, 1, 3)

    def token_slots(self, pages: list[int]) -> torch.Tensor:
        """Token slot indices of ``pages`` in the flattened ``[C, L, pages*page_size, H, D]`` view."""
        ps = self.geometry.page_size
        base = torch.tensor(pages, dtype=torch.long, device=self.device).view(-1, 1) * ps
        return (base + torch.arange(ps, device=self.device)).view(-1)
