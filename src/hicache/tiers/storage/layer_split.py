"""A storage tier for sliding-window hybrids: every page's full-attention layers, and its
sliding-window layers only where a continuation can need them.

Continuing a prefix of ``L`` tokens needs the full layers' KV for ``[0, L)`` but the sliding
layers' KV only for the window before ``L``. So a page is stored as two objects under names of
their own (``PageCodec.part``): the *full part* (its full-attention layers) always, the *sliding
part* (its sliding-window layers) only for the ``window_pages`` pages before the end of what is
written (a node of the index: where a stored prompt ends or another one branches off). On Gemma 3
(5 of 6 layers slide over 512 tokens) a 4,096-token prompt costs about a quarter of its whole pages.

What this tier promises, where the caller asks:

* ``exists`` answers the *restorable* length: the longest run of full parts whose last
  ``window_pages`` pages also have their sliding parts (``layer_kinds.restorable_end``), so a probe
  never promises a hit that cannot be continued exactly;
* ``fetch(..., sliding_from=i)`` reads sliding parts for pages ``i`` on, and zero-fills the sliding
  layers of the pages before ``i`` (*thin* pages: the index marks them, ``TreeNode.thin``, and no
  hit ends near them); a sliding part that is missing or fails verification shortens the fetch;
* ``store(..., sliding=flags)`` writes every page's full part and the sliding parts flagged.

Each part is verified like a page (header, checksum or MAC, codec chain), so a flipped byte in a
sliding part is a miss that shortens the hit, never other output. Both parts share one backend.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import numpy as np
import torch

from ..host import HostPool
from .base import StorageBackend
from .page_format import PageCodec
from .tier import DEFAULT_CODEC_THREADS, PageSource, StorageTier

__all__ = ["LayerSplitTier", "part_index"]


def part_index(components: int, num_layers: int, layers: Sequence[int]) -> tuple[int, ...]:
    """Which of a page's ``components * num_layers`` pieces (canonical order ``[C, L]``) hold ``layers``."""
    return tuple(c * num_layers + layer for c in range(components) for layer in layers)


class _PartPieces:
    """Pages as the pieces of some layers only (views, no copies), indexed by page."""

    def __init__(self, page_pieces: Any, index: tuple[int, ...], pieces_per_page: int) -> None:
        self._pages = page_pieces
        self._index = index
        self._count = pieces_per_page

    def __getitem__(self, page: int) -> tuple[Any, ...]:
        pieces = self._pages[page]
        if len(pieces) == 1 and self._count > 1:  # one contiguous page-first piece: cut it per layer
            pieces = np.asarray(memoryview(pieces[0])).reshape(self._count, -1)
        return tuple(pieces[i] for i in self._index)


class _PartSource:
    """A caller's ``PageSource`` seen through a part's layers."""

    def __init__(self, source: PageSource, index: tuple[int, ...], pieces_per_page: int) -> None:
        self._pieces = _PartPieces(source.page_pieces(), index, pieces_per_page)

    def page_pieces(self) -> _PartPieces:
        return self._pieces


class _PartTier(StorageTier):
    """A ``StorageTier`` over some layers of each page (its codec's geometry counts those only)."""

    def __init__(self, *args: Any, layers: tuple[int, ...], whole_layers: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        g = self.codec.geometry
        self._per_page = g.components * whole_layers
        self._index = part_index(g.components, whole_layers, layers)
        self._whole_layers = whole_layers

    def _host_pieces(self) -> Any:
        if self._pieces is None:
            assert self.host is not None, "a tier without a host pool is given a source on every call"
            raw = self.host.buffer.view(torch.uint8).numpy()
            if self.host.layout == "page_first":
                chunks = raw.reshape(self.host.num_pages, self._per_page, -1)
            else:
                chunks = raw.reshape(self._per_page, self.host.num_pages, -1).transpose(1, 0, 2)
            self._pieces = _PartPieces(chunks, self._index, self._per_page)  # type: ignore[assignment]
        return self._pieces

    def part_source(self, source: PageSource | None) -> PageSource | None:
        return None if source is None else _PartSource(source, self._index, self._per_page)

    def zero(self, host_pages: Sequence[int], source: PageSource | None) -> None:
        """Fill this part's layers of ``host_pages`` with zeros (thread-side work)."""
        pieces = self._host_pieces() if source is None else self.part_source(source).page_pieces()  # type: ignore[union-attr]
        for p in host_pages:
            for piece in pieces[p]:
                np.asarray(memoryview(piece)).fill(0)


class LayerSplitTier(_PartTier):
    """A tier whose pages are a full part (this tier) and a sliding part (``sliding_part``)."""

    def __init__(
        self,
        name: str,
        backend: StorageBackend,
        full_codec: PageCodec,
        sliding_codec: PageCodec,
        host: HostPool | None,
        *,
        full_layers: tuple[int, ...],
        sliding_layers: tuple[int, ...],
        window_pages: int,
        batch_pages: int,
        codec_threads: int = DEFAULT_CODEC_THREADS,
    ) -> None:
        whole = len(full_layers) + len(sliding_layers)
        self.sliding_part = _PartTier(
            name, backend, sliding_codec, host, batch_pages=batch_pages, codec_threads=codec_threads,
            layers=sliding_layers, whole_layers=whole,
        )
        super().__init__(
            name, backend, full_codec, host, batch_pages=batch_pages, codec_threads=codec_threads,
            layers=full_layers, whole_layers=whole,
        )
        self.window_pages = window_pages

    # ``detached`` reaches both parts (the controller sets it on the tier it knows).
    @property  # type: ignore[override]
    def detached(self) -> bool:
        return self._detached

    @detached.setter
    def detached(self, value: bool) -> None:
        self._detached = value
        self.sliding_part.detached = value

    async def wait_idle(self) -> None:
        await super().wait_idle()
        await self.sliding_part.wait_idle()

    async def __aexit__(self, *exc_info: object) -> None:
        pool, self.sliding_part._pool = self.sliding_part._pool, None
        if pool is not None:
            pool.shutdown(wait=False)
        self.sliding_part._pieces = None
        await super().__aexit__(*exc_info)

    async def full_parts(self, keys: Sequence[bytes]) -> int:
        """Consecutive pages of ``keys`` whose full parts are present from the start."""
        return await super().exists(keys)

    async def exists(self, keys: Sequence[bytes]) -> int:
        """Pages of ``keys`` that can be restored from the start: full parts present, and the
        sliding parts of the window before the answer's end."""
        end = await self.full_parts(keys)
        while end > 0:
            low = max(0, end - self.window_pages)
            have = await self.sliding_part.exists(keys[low:end])
            if have == end - low:
                return end
            end = low + have  # the first sliding part missing: no window may end past it
        return 0

    async def fetch(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        on_batch: Callable[[int, int], bool] | None = None,
        *,
        source: PageSource | None = None,
        sliding_from: int = 0,
    ) -> int:
        """Read the sliding parts of pages ``sliding_from`` on, zero the sliding layers of those
        before (thin pages), then read every full part (``on_batch`` as ``StorageTier.fetch``).
        Pages past a missing or corrupt sliding part are not read: the count returned stops there."""
        assert len(keys) == len(host_pages)
        sliding_from = min(max(0, sliding_from), len(keys))
        want = len(keys)
        if sliding_from < len(keys):
            got = await self.sliding_part.fetch(
                keys[sliding_from:], host_pages[sliding_from:], source=self.sliding_part.part_source(source)
            )
            want = sliding_from + got
        if sliding_from:
            await anyio.to_thread.run_sync(self.sliding_part.zero, host_pages[:sliding_from], source)
        if not want:
            return 0
        return await super().fetch(keys[:want], host_pages[:want], on_batch, source=self.part_source(source))

    async def fetch_checkpoints(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        at: Sequence[int],
        on_batch: Callable[[int, int], bool] | None = None,
        *,
        before_full: Callable[[list[int]], None] | None = None,
        source: PageSource | None = None,
    ) -> int:
        """A recurrent model's read-back: the state parts (checkpoints) of the pages at indices
        ``at``, zeros in those layers of every other page, then every full part (``on_batch`` as
        ``StorageTier.fetch``). A checkpoint that is missing or fails verification leaves its page
        thin, it does not shorten the read: ``before_full`` is told the indices read whole."""
        good: list[int] = []
        part_source = self.sliding_part.part_source(source)
        for i in at:
            if await self.sliding_part.fetch([keys[i]], [host_pages[i]], source=part_source) == 1:
                good.append(i)
        others = sorted(set(range(len(keys))) - set(good))
        if others:
            await anyio.to_thread.run_sync(self.sliding_part.zero, [host_pages[i] for i in others], source)
        if before_full is not None:
            before_full(good)
        return await super().fetch(keys, host_pages, on_batch, source=self.part_source(source))

    async def store(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        *,
        source: PageSource | None = None,
        sliding: Sequence[bool] | None = None,
    ) -> int:
        """Write every page's full part and the sliding parts ``sliding`` flags (all when ``None``);
        consecutive pages stored whole as asked (a flagged page whose sliding part failed ends it)."""
        assert sliding is None or len(sliding) == len(keys)
        n = await super().store(keys, host_pages, source=self.part_source(source))
        chosen = [i for i in range(n) if sliding is None or sliding[i]]
        if not chosen:
            return n
        m = await self.sliding_part.store(
            [keys[i] for i in chosen], [host_pages[i] for i in chosen], source=self.sliding_part.part_source(source)
        )
        return n if m == len(chosen) else chosen[m]

    async def _suffix_from(self, keys: Sequence[bytes], lo: int) -> int:
        """The smallest ``i >= lo`` whose ``keys[i:]`` all have their sliding parts (``len(keys)``
        when the last has none): a binary search, as a suffix of present parts stays present."""
        n = len(keys)
        hi = n
        while lo < hi:
            mid = (lo + hi) // 2
            if await self.sliding_part.exists(keys[mid:]) == n - mid:
                hi = mid
            else:
                lo = mid + 1
        return hi

    async def sliding_present_from(self, keys: Sequence[bytes], offset: int = 0) -> int:
        """``offset`` plus the first index from which every one of ``keys`` has its sliding part."""
        return offset + await self._suffix_from(keys, 0)

    async def store_sliding(self, keys: Sequence[bytes], host_pages: Sequence[int]) -> int:
        """Write the sliding parts of pages whose full parts are stored (the window of a later end)
        that are missing between those present at the start and those present at the end (a new
        end before a stored one lacks the first pages of its window only); the parts written."""
        n = len(keys)
        first = await self.sliding_part.exists(keys)
        if first == n:
            return 0
        hi = await self._suffix_from(keys, first + 1)
        return await self.sliding_part.store(keys[first:hi], host_pages[first:hi])

    def payload_bytes(self, pages: int, sliding: int = 0) -> int:
        """KV bytes of ``pages`` full parts and ``sliding`` sliding parts (before codecs and headers)."""
        return pages * self.codec.payload_bytes + sliding * self.sliding_part.codec.payload_bytes

    async def has_mark(self, key: bytes) -> bool:
        return await StorageTier.exists(self, [key]) == 1
