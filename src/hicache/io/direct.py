"""The ``direct`` io backend: one ``copy_`` per page, the simple reference the kernel path is checked against.

Pays about 1-4 microseconds of dispatch per page and per layer; fine for large pages, slow for small.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import IOBackend

__all__ = ["DirectIOBackend"]


class DirectIOBackend(IOBackend):
    name = "direct"

    def plan(self, src_idx: Sequence[int], dst_idx: Sequence[int], src_device: torch.device, dst_device: torch.device) -> list[tuple[int, int]]:
        assert len(src_idx) == len(dst_idx)
        return list(zip(src_idx, dst_idx))

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: list[tuple[int, int]], *, layer: int | None = None) -> None:
        non_blocking = dst.device.type == "cuda"
        for s, d in plan:
            dst[d].copy_(src[s], non_blocking=non_blocking)
