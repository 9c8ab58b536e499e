"""How pages move: the io backend interface.

An io backend copies pages between two *page-major views* (see ``tiers/base.py``): ``src[src_idx[i]]``
goes to ``dst[dst_idx[i]]``. It is synchronous and runs in a worker thread (or enqueues on a CUDA
stream); the controller owns scheduling. ``plan()`` turns index lists into whatever the backend
wants once per transfer, so that a layer-by-layer load reuses it for every layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["IOBackend"]


class IOBackend(ABC):
    """Copies pages between two page-major views."""

    name: str = "io"

    @abstractmethod
    def plan(self, src_idx: Sequence[int], dst_idx: Sequence[int], src_device: torch.device, dst_device: torch.device) -> Any:
        """Precompute what ``copy`` needs for these indices."""

    @abstractmethod
    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        """Copy the planned pages from ``src`` to ``dst``.

        ``layer`` says which layer the views belong to (``None``: all layers at once); backends may
        ignore it; fault-injecting fakes use it.
        """
