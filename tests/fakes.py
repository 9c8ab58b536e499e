"""Fault-injecting fakes, named as such: io backends that stall or fail, storage backends that fail,
stall, crawl or fail every other write. Storage fakes are configured by class path, e.g.
``{"kind": "tests.fakes:SlowStorageBackend", "delay_s": 0.1}``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from hicache.io.kernel import KernelIOBackend
from hicache.tiers.storage.base import PageIO, StorageBackend
from hicache.tiers.storage.memory import MemoryBackend


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


# -- storage backends that misbehave on purpose ------------------------------------------------


class FailingStorageBackend(StorageBackend):
    """Fault fake: every operation raises, like a backend whose server is gone."""

    kind = "failing"

    async def _exists(self, keys: Sequence[bytes]) -> int:
        raise ConnectionError("storage server unreachable")

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        raise ConnectionError("storage server unreachable")

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        raise ConnectionError("storage server unreachable")


class StallingStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but every call hangs until cancelled (a dead peer)."""

    kind = "stalling"

    async def _exists(self, keys: Sequence[bytes]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


class SlowStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but each page read takes ``delay_s`` (a slow disk or link)."""

    kind = "slow"

    class Settings(MemoryBackend.Settings):
        delay_s: float = 0.05

    settings: Settings

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        for i in range(len(keys)):
            await anyio.sleep(self.settings.delay_s)
            if await super()._get(keys[i : i + 1], into[i : i + 1]) == 0:
                return i
        return len(keys)


class FlakyStorageBackend(MemoryBackend):
    """Fault fake: the in-memory backend, but every other ``set`` call fails after storing nothing."""

    kind = "flaky"

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.set_calls = 0

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        self.set_calls += 1
        if self.set_calls % 2 == 0:
            raise OSError("disk full")
        return await super()._set(keys, pages)
