"""``kind: memory``: an in-process backend, the reference example for writing backends.

Pages live in an ordered dict (least recently used first) bounded by ``capacity`` bytes. It shares
nothing across processes; use it to try a storage tier, in tests, or as a template.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

from ...config import ByteSize
from .base import BackendSettings, PageIO, StorageBackend, StoredPage, fits, scatter

__all__ = ["MemoryBackend"]


class MemoryBackend(StorageBackend):
    kind = "memory"
    can_list = True
    variable_size_pages = True

    class Settings(BackendSettings):
        capacity: ByteSize = 1024**3

    settings: Settings

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self._pages: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0

    async def _exists(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if key not in self._pages:
                return i
        return len(keys)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return self._read(keys, into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return self._read(keys, into, sizes)

    def _read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        for i, (key, io) in enumerate(zip(keys, into, strict=True)):
            blob = self._pages.get(key)
            if blob is None or not fits(len(blob), io.nbytes, sizes):
                return i
            self._pages.move_to_end(key)
            scatter(blob, io)
            if sizes is not None:
                sizes[i] = len(blob)
        return len(keys)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        # Pages of this call are never evicted for later ones: a page is useless without the
        # pages before it (keys are chained), so when the capacity runs out the call stops.
        batch = set(keys)
        for i, (key, io) in enumerate(zip(keys, pages, strict=True)):
            self._drop(key)
            victims = (k for k in self._pages if k not in batch)
            while self._used + io.nbytes > self.settings.capacity:
                victim = next(victims, None)
                if victim is None:
                    return i
                self._drop(victim)
                self.evicted_pages += 1
                victims = (k for k in self._pages if k not in batch)
            self._pages[key] = b"".join(io.buffers())
            self._used += io.nbytes
        return len(keys)

    def _drop(self, key: bytes) -> None:
        blob = self._pages.pop(key, None)
        if blob is not None:
            self._used -= len(blob)

    async def _delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._drop(key)

    async def _clear(self) -> None:
        self._pages.clear()
        self._used = 0

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        yield [StoredPage(key, len(blob), None) for key, blob in list(self._pages.items())]

    def _usage(self) -> tuple[int, int, int]:
        return self._used, self.settings.capacity, len(self._pages)
