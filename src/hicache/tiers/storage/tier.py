"""A storage tier: one backend bound to this cache's namespace, page format and host pool.

The controller speaks host pages; backends speak keys and bytes. ``StorageTier`` sits between: it
lends the host pool's own memory as each page's payload (one piece per page for ``page_first``, one
per component and layer for ``layer_first``), so reads land in place and writes read in place with
no staging copy; it writes and checks headers in a worker thread (one hop per batch); and it turns
every backend failure into a miss or an unrecorded write, counted, so a broken backend can never
fail a request.

Backends never see page keys: the codec names each page (``PageCodec.storage_keys``; with a tenant
key, a keyed hash of the page key) and the tier hands those names down, and checks every page read
against its name, so a page stored under another name, by another tenant or by a forger is a miss.

The pages need not live in hicache's own host pool: ``fetch`` and ``store`` take a ``source``, any
object whose ``page_pieces()`` lends pages as byte pieces (an engine's own host pool, as the SGLang
backend does, or a few loose page buffers); by default the tier's host pool.

Detaching (``HiCache.detach_storage``): once ``detached`` is set, every operation is a miss or an
unwritten page without calling the backend, and ``wait_idle()`` returns when the calls already in
flight have ended, so the backend can be closed under nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import anyio
import numpy as np
import torch

from ...errors import StorageError
from ...logs import RateLimited
from ...stats import StorageTierStats
from ..host import HostPool
from .base import PageIO, StorageBackend
from .page_format import HEADER_BYTES, PageCodec

__all__ = ["PageSource", "StorageTier"]

log = logging.getLogger(__name__)


class PageSource(Protocol):
    """Memory a tier reads pages into and writes them from, other than its host pool."""

    def page_pieces(self) -> Any:
        """Indexed by page: that page's payload as buffers (writable for ``fetch``), in the byte
        order its namespace stores (canonical for hicache's own pools), adding up to the codec's
        payload bytes."""
        ...


class StorageTier:
    def __init__(
        self,
        name: str,
        backend: StorageBackend,
        codec: PageCodec,
        host: HostPool | None,
        *,
        batch_pages: int,
    ) -> None:
        self.name = name
        self.backend = backend
        self.codec = codec
        self.host = host
        self.batch_pages = max(1, batch_pages)
        self.fetched_pages = 0
        self.stored_pages = 0
        self.skipped_pages = 0
        self.failures = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.detached = False  # set by detach: no new backend call starts
        self._in_flight = 0
        self._idle = anyio.Event()
        self._idle.set()
        self._pieces: np.ndarray | None = None  # byte view of the host pool, indexed by page
        self._healthy = True
        self._corrupt_log = RateLimited(log)

    # -- detaching ------------------------------------------------------------------------------

    def _enter(self) -> bool:
        """Count a call in flight; False (do nothing, a miss) once the tier is detached."""
        if self.detached:
            return False
        if self._in_flight == 0:
            self._idle = anyio.Event()
        self._in_flight += 1
        return True

    def _exit(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return when no call is in flight (each is bounded by the backend's ``timeout_s``)."""
        while self._in_flight:
            await self._idle.wait()

    async def __aenter__(self) -> StorageTier:
        await self.backend.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._pieces = None
        await self.backend.aclose()

    # -- buffers --------------------------------------------------------------------------------

    def _host_pieces(self) -> np.ndarray:
        """The host pool as bytes: ``[pages, 1, page_bytes]`` or ``[pages, C * L, chunk_bytes]``."""
        if self._pieces is None:
            assert self.host is not None, "a tier without a host pool is given a source on every call"
            g = self.codec.geometry
            raw = self.host.buffer.view(torch.uint8).numpy()  # no copy; the pool outlives the tier's use
            if self.host.layout == "page_first":
                self._pieces = raw.reshape(self.host.num_pages, 1, -1)
            else:
                chunks = raw.reshape(g.components * g.num_layers, self.host.num_pages, -1)
                self._pieces = chunks.transpose(1, 0, 2)  # a view: page-major order of the pieces
        return self._pieces

    def _page_ios(self, host_pages: Sequence[int], source: PageSource | None = None) -> list[PageIO]:
        """Header buffers, and each host page's own memory as its payload pieces."""
        headers = np.zeros((len(host_pages), HEADER_BYTES), dtype=np.uint8)
        pieces = self._host_pieces() if source is None else source.page_pieces()
        return [
            PageIO(memoryview(headers[i]), tuple(memoryview(piece) for piece in pieces[p]))
            for i, p in enumerate(host_pages)
        ]

    # -- thread-side work -----------------------------------------------------------------------

    def _encode(
        self, keys: Sequence[bytes], host_pages: Sequence[int], source: PageSource | None = None
    ) -> list[PageIO]:
        ios = self._page_ios(host_pages, source)
        for key, io in zip(keys, ios, strict=True):
            self.codec.encode(key, io.payload, io.header)
        return ios

    def _verify(self, keys: Sequence[bytes], ios: Sequence[PageIO]) -> tuple[int, str | None]:
        """Check pages in order: ``(how many are good, why the next one is not)``."""
        for i, (key, io) in enumerate(zip(keys, ios, strict=True)):
            reason = self.codec.check(key, io.header, io.payload)
            if reason is not None:
                return i, reason
        return len(keys), None

    # -- operations -----------------------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> int:
        """Consecutive pages of ``keys`` present from the start (0 when the backend fails)."""
        if not keys or not self._enter():
            return 0
        try:
            found = await self.backend.exists(self.codec.storage_keys(keys))
        except StorageError as exc:
            self._failed(exc)
            return 0
        finally:
            self._exit()
        self._succeeded()
        return found

    async def fetch(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        on_batch: Callable[[int, int], bool] | None = None,
        *,
        source: PageSource | None = None,
    ) -> int:
        """Read pages ``keys`` into ``host_pages`` (allocated, not yet published) of the host pool
        (or of ``source``); verified count.

        Batches are pipelined: the next batch is read while this one is verified. After each
        batch, ``on_batch(first, good)`` may publish its ``good`` verified pages (indices
        ``first..first+good`` of ``host_pages``) and return False to stop. Pages past the returned
        count hold garbage and are the caller's to free. A page that fails verification is counted
        as corrupt and deleted from the backend, so a later ``store`` writes the page again.
        """
        assert len(keys) == len(host_pages)
        if not self._enter():
            return 0
        try:
            return await self._fetch(keys, host_pages, on_batch, source)
        finally:
            self._exit()

    async def _fetch(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        on_batch: Callable[[int, int], bool] | None,
        source: PageSource | None = None,
    ) -> int:
        keys = self.codec.storage_keys(keys)
        starts = range(0, len(keys), self.batch_pages)
        total = 0
        send, receive = anyio.create_memory_object_stream[tuple[int, list[PageIO], int]](1)

        async def read_ahead() -> None:
            async with send:
                for first in starts:
                    k = keys[first : first + self.batch_pages]
                    ios = self._page_ios(host_pages[first : first + self.batch_pages], source)
                    try:
                        n = await self.backend.get(k, ios)
                        self._succeeded()
                    except StorageError as exc:
                        self._failed(exc)
                        n = -1
                    if 0 <= n < len(k):
                        # The page after the last one read was reported present: it is gone, or a
                        # value of the wrong size sits under its name (torn, or planted there). Drop
                        # it, so it cannot make a later store skip the page as already stored.
                        await self._drop(k[n])
                    n = max(n, 0)
                    await send.send((first, ios, n))
                    if n < len(k):
                        return

        # The reader's threads write into host_pages: the group waits for them before returning,
        # even when cancelled, so the caller never frees a page that is still being written.
        async with anyio.create_task_group() as tg:
            tg.start_soon(read_ahead)
            async with receive:
                async for first, ios, n in receive:
                    k = keys[first : first + len(ios)]
                    good, reason = await anyio.to_thread.run_sync(self._verify, k[:n], ios[:n])
                    total += good
                    self.fetched_pages += good
                    if reason is not None:
                        await self._drop_corrupt(k[good], reason)
                    go_on = on_batch(first, good) if on_batch is not None else True
                    if good < len(k) or not go_on:
                        tg.cancel_scope.cancel()
                        break
        return total

    async def _drop_corrupt(self, key: bytes, reason: str) -> None:
        self.backend.corrupt_pages += 1
        self._corrupt_log.warning(
            reason, "storage tier %s: page %s failed verification (%s); dropped (%d corrupt pages so far)",
            self.name, key.hex(), reason, self.backend.corrupt_pages,
        )
        await self._drop(key)

    async def _drop(self, key: bytes) -> None:
        try:
            await self.backend.delete([key])
        except StorageError as exc:
            self._failed(exc)

    async def store(
        self, keys: Sequence[bytes], host_pages: Sequence[int], *, source: PageSource | None = None
    ) -> int:
        """Write ``host_pages`` (pinned by the caller) of the host pool (or of ``source``) under
        ``keys``; consecutive pages stored.

        Headers (checksums or MACs) of the next batch are encoded in a worker thread while this
        batch is written, so a MAC's CPU time hides behind the backend's I/O.
        """
        assert len(keys) == len(host_pages)
        if not self._enter():
            return 0
        try:
            return await self._store(keys, host_pages, source)
        finally:
            self._exit()

    async def _store(
        self, keys: Sequence[bytes], host_pages: Sequence[int], source: PageSource | None = None
    ) -> int:
        keys = self.codec.storage_keys(keys)
        step = self.batch_pages
        starts = range(0, len(keys), step)
        total = 0
        encoded: dict[int, list[PageIO]] = {}

        async def encode(start: int) -> None:
            encoded[start] = await anyio.to_thread.run_sync(
                self._encode, keys[start : start + step], host_pages[start : start + step], source
            )

        if starts:
            await encode(0)
        for i, start in enumerate(starts):
            k = keys[start : start + step]
            ios = encoded.pop(start)
            # The group waits for the next batch's encoding (it reads pinned host pages) before
            # this returns, whatever the write did.
            async with anyio.create_task_group() as tg:
                if i + 1 < len(starts):
                    tg.start_soon(encode, starts[i + 1])
                try:
                    n = await self.backend.set(k, ios)
                    self._succeeded()
                except StorageError as exc:
                    self._failed(exc)
                    n = -1
            if n < 0:
                return total
            total += n
            self.stored_pages += n
            if n < len(k):
                break
        return total

    def _failed(self, exc: StorageError) -> None:
        # One warning when the tier starts failing, not one per request while it stays down.
        self.failures += 1
        if self._healthy:
            self._healthy = False
            log.warning(
                "storage tier %s: %s; treated as misses (more failures logged at debug level; %d so far)",
                self.name, exc, self.failures,
            )
        else:
            log.debug("storage tier %s: %s", self.name, exc)

    def _succeeded(self) -> None:
        if not self._healthy:
            self._healthy = True
            log.warning("storage tier %s: answering again after %d failed calls", self.name, self.failures)

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
            miss_tokens=self.miss_tokens,
        )

    def __repr__(self) -> str:
        return f"<StorageTier {self.name} {self.backend!r}>"
