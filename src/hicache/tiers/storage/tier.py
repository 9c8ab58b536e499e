"""A storage tier: one backend bound to this cache's namespace, page format and host pool.

The controller speaks host pages; backends speak keys and bytes. ``StorageTier`` sits between: it
builds the ``PageIO`` buffers (a page-first host pool lends its pages themselves, so reads land in
place and writes read in place; a layer-first pool goes through a staging buffer), writes and checks
headers in a worker thread (one hop per batch), and turns every backend failure into a miss or an
unrecorded write, counted, so a broken backend can never fail a request.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

import anyio
import numpy as np
import torch

from ...errors import StorageError
from ...stats import StorageTierStats
from ..host import HostPool
from .base import PageIO, StorageBackend
from .page_format import HEADER_BYTES, PageCodec

__all__ = ["StorageTier"]

log = logging.getLogger(__name__)


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(t.view(torch.uint8).view(-1).numpy())


class StorageTier:
    def __init__(
        self,
        name: str,
        backend: StorageBackend,
        codec: PageCodec,
        host: HostPool,
        *,
        batch_pages: int,
        limiter: anyio.CapacityLimiter | None = None,
    ) -> None:
        self.name = name
        self.backend = backend
        self.codec = codec
        self.host = host
        self.batch_pages = max(1, batch_pages)
        self.limiter = limiter
        self.fetched_pages = 0
        self.stored_pages = 0
        self.skipped_pages = 0
        self.failures = 0
        self.hit_tokens = 0
        # Layer-first pools stage pages through reusable buffers (a fresh allocation page-faults
        # at ~2.7 GB/s here); one for reads and one for writes, each used by one batch at a time.
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_locks = {"read": anyio.Lock(), "write": anyio.Lock()}

    async def __aenter__(self) -> StorageTier:
        await self.backend.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.backend.aclose()

    # -- buffers --------------------------------------------------------------------------------

    @property
    def _in_place(self) -> bool:
        return self.host.layout == "page_first"

    def _page_ios(self, host_pages: Sequence[int], direction: str) -> tuple[list[PageIO], torch.Tensor | None]:
        """Header and payload buffers for ``host_pages``; the staging rows when not in place.

        Not in place, the caller holds ``self._staging_locks[direction]`` while the buffers live.
        """
        headers = np.zeros((len(host_pages), HEADER_BYTES), dtype=np.uint8)
        if self._in_place:
            buf = self.host.buffer
            return [PageIO(memoryview(headers[i]), _bytes_of(buf[p])) for i, p in enumerate(host_pages)], None
        staging = self._staging.get(direction)
        if staging is None:
            staging = torch.zeros((self.batch_pages, self.codec.payload_bytes), dtype=torch.uint8)  # pre-faulted
            self._staging[direction] = staging
        staging = staging[: len(host_pages)]
        return [PageIO(memoryview(headers[i]), _bytes_of(staging[i])) for i in range(len(host_pages))], staging

    def _staged_view(self, staging: torch.Tensor) -> torch.Tensor:
        """The staging rows as page-major ``[n, C, L, E]`` in the KV dtype."""
        g = self.codec.geometry
        return staging.view(g.dtype).view(staging.shape[0], g.components, g.num_layers, g.page_elems)

    # -- thread-side work -----------------------------------------------------------------------

    def _encode(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> list[PageIO]:
        ios, staging = self._page_ios(host_pages, "write")
        if staging is not None:
            # One strided copy per page (C x L runs of a page's elements): ~8 GB/s here.
            pm, dst = self.host.page_major(), self._staged_view(staging)
            for i, p in enumerate(host_pages):
                dst[i].copy_(pm[p])
        for key, io in zip(keys, ios, strict=True):
            self.codec.encode(key, io.payload, io.header)
        return ios

    def _verify(
        self, keys: Sequence[bytes], ios: Sequence[PageIO], staging: torch.Tensor | None, host_pages: Sequence[int]
    ) -> tuple[int, str | None]:
        """Check pages in order; place staged ones in the host pool. ``(good, why the next is bad)``."""
        good, reason = len(keys), None
        for i, (key, io) in enumerate(zip(keys, ios, strict=True)):
            reason = self.codec.check(key, io.header, io.payload)
            if reason is not None:
                good = i
                break
        if staging is not None and good:
            pm = self.host.page_major()
            src = self._staged_view(staging)
            for i in range(good):
                pm[host_pages[i]].copy_(src[i])
        return good, reason

    # -- operations -----------------------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> int:
        """Consecutive pages of ``keys`` present from the start (0 when the backend fails)."""
        if not keys:
            return 0
        try:
            return await self.backend.exists(keys)
        except StorageError as exc:
            self._failed(exc)
            return 0

    async def fetch(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Read pages ``keys`` into ``host_pages`` (allocated, not yet published); verified count.

        Pages past the count hold garbage and must be freed by the caller. A page that fails
        verification is counted as corrupt and deleted from the backend.
        """
        assert len(keys) == len(host_pages)
        total = 0
        for start in range(0, len(keys), self.batch_pages):
            k = keys[start : start + self.batch_pages]
            pages = host_pages[start : start + self.batch_pages]
            async with self._staging_lock("read"):
                ios, staging = self._page_ios(pages, "read")
                try:
                    n = await self.backend.get(k, ios)
                except StorageError as exc:
                    self._failed(exc)
                    return total
                good, reason = await anyio.to_thread.run_sync(
                    self._verify, k[:n], ios[:n], staging, pages, limiter=self.limiter
                )
            total += good
            self.fetched_pages += good
            if reason is not None:
                self.backend.corrupt_pages += 1
                log.warning(
                    "storage tier %s: page %s failed verification (%s); dropped", self.name, k[good].hex(), reason
                )
                try:
                    await self.backend.delete([k[good]])
                except StorageError as exc:
                    self._failed(exc)
            if good < len(k):
                break
        return total

    async def store(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Write ``host_pages`` (pinned by the caller) under ``keys``; consecutive pages stored."""
        assert len(keys) == len(host_pages)
        total = 0
        for start in range(0, len(keys), self.batch_pages):
            k = keys[start : start + self.batch_pages]
            async with self._staging_lock("write"):
                ios = await anyio.to_thread.run_sync(
                    self._encode, k, host_pages[start : start + self.batch_pages], limiter=self.limiter
                )
                try:
                    n = await self.backend.set(k, ios)
                except StorageError as exc:
                    self._failed(exc)
                    return total
            total += n
            self.stored_pages += n
            if n < len(k):
                break
        return total

    def _staging_lock(self, direction: str) -> anyio.Lock | contextlib.nullcontext[None]:
        return contextlib.nullcontext() if self._in_place else self._staging_locks[direction]

    def _failed(self, exc: StorageError) -> None:
        self.failures += 1
        log.warning("storage tier %s: %s (treated as a miss)", self.name, exc)

    def stats(self) -> StorageTierStats:
        return StorageTierStats(
            name=self.name,
            kind=self.backend.kind,
            fetched_pages=self.fetched_pages,
            stored_pages=self.stored_pages,
            skipped_pages=self.skipped_pages,
            failures=self.failures,
            hit_tokens=self.hit_tokens,
            backend=self.backend.stats(),
        )

    def __repr__(self) -> str:
        return f"<StorageTier {self.name} {self.backend!r}>"
