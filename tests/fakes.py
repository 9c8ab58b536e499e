"""Fault-injecting fakes, named as such: an io backend that stalls and one that fails."""

from __future__ import annotations

import threading
from typing import Any

import torch

from hicache.io.kernel import KernelIOBackend


class StallingIOBackend(KernelIOBackend):
    """The real kernel backend, but per-layer copies of ``stall_layer`` and later wait for ``release()``.

    Only layer-wise copies (``layer`` given) stall, so stores and backups run normally.
    """

    def __init__(self, stall_layer: int) -> None:
        self.stall_layer = stall_layer
        self._gate = threading.Event()
        self.stalled = threading.Event()  # set once a copy is waiting at the gate
        self.layers_copied: list[int] = []

    def release(self) -> None:
        self._gate.set()

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        if layer is not None and layer >= self.stall_layer:
            self.stalled.set()
            if not self._gate.wait(timeout=30):
                raise TimeoutError("StallingIOBackend was never released")
        super().copy(src, dst, plan, layer=layer)
        if layer is not None:
            self.layers_copied.append(layer)


class FailingIOBackend(KernelIOBackend):
    """The real kernel backend until ``armed``; then every copy raises ``OSError``."""

    def __init__(self) -> None:
        self.armed = False

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: Any, *, layer: int | None = None) -> None:
        if self.armed:
            raise OSError("injected copy failure")
        super().copy(src, dst, plan, layer=layer)
