"""A storage tier: one backend bound to this cache's namespace, page format and host pool.

The controller speaks host pages; backends speak keys and bytes. ``StorageTier`` sits between: it
lends the host pool's own memory as each page's payload (one piece per page for ``page_first``, one
per component and layer for ``layer_first``), so reads land in place and writes read in place with
no staging copy; it writes and checks headers off the event loop (below); and it turns
every backend failure into a miss or an unrecorded write, counted, so a broken backend can never
fail a request.

Backends never see page keys: the codec names each page (``PageCodec.storage_keys``; with a tenant
key, a keyed hash of the page key) and the tier hands those names down, and checks every page read
against its name, so a page stored under another name, by another tenant or by a forger is a miss.

**Page work in parallel, where the bytes are.** Checksums or MACs (and a codec chain's stages) run
off the event loop, never one thread hop per page:

* *writes of exact pages* (no codec chain) to a backend that ``seals_pages`` (the file tier):
  each page's header is sealed by the backend's writer thread right before it writes the page
  (``PageIO.seal``), so the MAC and the write of a page are one thread's back-to-back work, the
  writer threads use every core, and no encoding stage waits in front of the first write; to other
  backends, a batch's headers are encoded on the codec threads while the previous batch is written;
* *reads of exact pages*: each batch's checks start as its pages land (``PageIO.landed``, from the
  backend's thread; ``page_checks.BatchChecks``), in groups of about 2 MiB on the tier's pool of
  ``codec_threads`` threads, so pages are checked while the backend reads the next ones, and the
  batch's result is usually ready when ``get`` returns (no hop to collect it);
* *a codec chain*: one task per page on the same pool, a batch encoded while the previous one is
  written, decoded after it is read (OpenSSL's AES-GCM and GMAC, xxh3, blosc2 and torch release the GIL).

**A codec chain** (``PageCodec.chain``, the tier's ``codec:`` list): pages are no longer the host
page's own bytes. Writes encode each page into its own buffer (the chain's output) and the header
records the stages; reads go into staging buffers reused from batch to batch (room for the largest
page the chain can make), with ``get(..., sizes=)`` since stored sizes vary, and each page is
checked, then decoded straight into its host page. Neither touches the device: host pages are
encoded after the device-to-host copy and decoded before the host-to-device one.

The pages need not live in hicache's own host pool: ``fetch`` and ``store`` take a ``source``, any
object whose ``page_pieces()`` lends pages as byte pieces (an engine's own host pool, as the SGLang
backend does, or a few loose page buffers); by default the tier's host pool.

Detaching (``HiCache.detach_storage``): once ``detached`` is set, every operation is a miss or an
unwritten page without calling the backend, and ``wait_idle()`` returns when the calls already in
flight have ended, so the backend can be closed under nobody.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import anyio
import numpy as np
import torch

from ...errors import ConfigError, StorageError
from ...logs import RateLimited
from ...stats import CodecStats, StorageTierStats
from ..host import HostPool
from .base import PageIO, StorageBackend
from .page_checks import BatchChecks
from .page_format import HEADER_BYTES, PageCodec

T = TypeVar("T")
#: Threads that encode and check one batch's pages at once (per tier; at least 1).
DEFAULT_CODEC_THREADS = max(1, min(8, os.cpu_count() or 1))

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
    #: Pages before a restorable end whose sliding layers it must hold; 0: pages are stored whole
    #: (``layer_split.LayerSplitTier`` keeps sliding layers near prefix ends only).
    window_pages = 0

    def __init__(
        self,
        name: str,
        backend: StorageBackend,
        codec: PageCodec,
        host: HostPool | None,
        *,
        batch_pages: int,
        codec_threads: int = DEFAULT_CODEC_THREADS,
    ) -> None:
        if codec.encoded and not type(backend).variable_size_pages:
            raise ConfigError(
                f"storage tier {name}: the {backend.kind} backend stores pages of one size only, and a codec chain "
                f"({', '.join(codec.chain.names)}) makes pages of varying size: remove `codec` from this tier"
            )
        self.name = name
        self.backend = backend
        self.codec = codec
        self.host = host
        self.batch_pages = max(1, batch_pages)
        self.codec_threads = max(1, codec_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._arenas: list[np.ndarray] = []  # staging buffers of reads through a codec chain, reused
        self._codec_counts = dict.fromkeys(
            ("encoded_pages", "encoded_logical_bytes", "encoded_stored_bytes", "decoded_pages",
             "decoded_logical_bytes", "decoded_stored_bytes", "failed_pages"), 0,
        )
        self._codec_seconds = {"encode": 0.0, "decode": 0.0}
        self.fetched_pages = 0
        self.stored_pages = 0
        self.skipped_pages = 0
        self.failures = 0
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.detached = False  # set by detach: no new backend call starts
        #: Told ``(tier name, page keys, storage keys)`` of pages written and sealed (the KV events).
        self.stored_hook: Callable[[str, Sequence[bytes], Sequence[bytes]], None] | None = None
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
        self._arenas.clear()
        try:
            await self.backend.aclose()
        finally:
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False)  # idle between calls: every batch waited for its tasks

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

    def _page_ios(
        self,
        host_pages: Sequence[int],
        source: PageSource | None = None,
        *,
        seal_keys: Sequence[bytes] | None = None,
        landed: Callable[[int], Callable[[], None] | None] | None = None,
    ) -> list[PageIO]:
        """Header buffers, and each host page's own memory as its payload pieces.

        ``seal_keys``: each page's ``seal`` encodes its header under that storage key (for a
        backend that seals pages in its writer threads); ``landed``: each page's ``landed`` hook.
        """
        headers = np.zeros((len(host_pages), HEADER_BYTES), dtype=np.uint8)
        pieces = self._host_pieces() if source is None else source.page_pieces()
        out = []
        encode = self.codec.encode
        for i, p in enumerate(host_pages):
            header = memoryview(headers[i])
            payload = tuple(memoryview(piece) for piece in pieces[p])
            seal = None if seal_keys is None else functools.partial(encode, seal_keys[i], payload, header)
            out.append(PageIO(header, payload, seal, None if landed is None else landed(i)))
        return out

    def _checked_ios(
        self, keys: Sequence[bytes], host_pages: Sequence[int], source: PageSource | None
    ) -> tuple[list[PageIO], BatchChecks]:
        """A batch's destinations in the host pages, and their checks, started as pages land."""
        ios: list[PageIO] = []

        def check(i: int) -> str | None:
            return self.codec.check(keys[i], ios[i].header, ios[i].payload)

        checks = BatchChecks(check, len(keys), self.codec.payload_bytes, self._submitter())
        ios.extend(self._page_ios(host_pages, source, landed=checks.hook))
        return ios, checks

    def _room(self) -> int:
        """Bytes of staging per page read through the codec chain: a header and the largest payload."""
        return HEADER_BYTES + self.codec.max_stored_bytes

    def _take_arena(self, pages: int) -> np.ndarray:
        need = pages * self._room()
        for i, arena in enumerate(self._arenas):
            if arena.nbytes >= need:
                return self._arenas.pop(i)
        return np.empty(max(need, self.batch_pages * self._room()), dtype=np.uint8)

    def _give_arena(self, arena: np.ndarray) -> None:
        if len(self._arenas) < 4:
            self._arenas.append(arena)

    def _staging_ios(self, arena: np.ndarray, pages: int) -> list[PageIO]:
        room = self._room()
        return [
            PageIO(memoryview(arena[i * room : i * room + HEADER_BYTES]),
                   (memoryview(arena[i * room + HEADER_BYTES : (i + 1) * room]),))
            for i in range(pages)
        ]

    # -- thread-side work -----------------------------------------------------------------------

    @property
    def _parallel(self) -> bool:
        """Whether page work is worth a task per page (MACs, codecs), not one thread per batch (xxh3)."""
        return self.codec_threads > 1 and (self.codec.keyed or self.codec.encoded)

    def _submitter(self) -> Callable[..., Any] | None:
        """The codec pool's ``submit`` for checks of pages read in place (``None``: one thread only)."""
        if self.codec_threads < 2:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.codec_threads, thread_name_prefix=f"hicache-codec-{self.name}")
        return self._pool.submit

    def _map(self, fn: Callable[[int], T], n: int) -> Iterable[T]:
        """``fn(0..n-1)``, in parallel on the tier's pool when that pays; results in order, lazily."""
        if not self._parallel or n < 2:
            return map(fn, range(n))
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.codec_threads, thread_name_prefix=f"hicache-codec-{self.name}")
        return self._pool.map(fn, range(n))

    def _encode(
        self, keys: Sequence[bytes], host_pages: Sequence[int], source: PageSource | None = None
    ) -> tuple[list[PageIO], dict[str, Any]]:
        ios = self._page_ios(host_pages, source)
        if not self.codec.encoded:

            def mac(i: int) -> None:
                self.codec.encode(keys[i], ios[i].payload, ios[i].header)

            for _ in self._map(mac, len(keys)):
                pass
            return ios, {}

        def one(i: int) -> tuple[PageIO, float]:
            t0 = time.perf_counter()
            header, stored = self.codec.encode_page(keys[i], ios[i].payload)
            return PageIO.of(header, stored), time.perf_counter() - t0

        done = list(self._map(one, len(keys)))
        out = [io for io, _ in done]
        return out, {
            "encoded_pages": len(out), "encoded_logical_bytes": len(out) * self.codec.payload_bytes,
            "encoded_stored_bytes": sum(io.payload_bytes for io in out), "encode": sum(t for _, t in done),
        }

    def _verify(
        self,
        keys: Sequence[bytes],
        ios: Sequence[PageIO],
        sizes: Sequence[int],
        host_pages: Sequence[int],
        source: PageSource | None = None,
    ) -> tuple[int, str | None, dict[str, Any]]:
        """Check pages in order (through a codec chain: check, then decode into ``host_pages``):
        ``(how many are good, why the next one is not, codec counts)``."""
        if not self.codec.encoded:

            def check(i: int) -> str | None:
                return self.codec.check(keys[i], ios[i].header, ios[i].payload)

            for i, reason in enumerate(list(self._map(check, len(keys)))):  # every task done before we return
                if reason is not None:
                    return i, reason, {}
            return len(keys), None, {}
        pieces = self._host_pieces() if source is None else source.page_pieces()

        def decode(i: int) -> tuple[str | None, float]:
            t0 = time.perf_counter()
            stored = ios[i].payload[0][: sizes[i] - HEADER_BYTES]
            out = [memoryview(piece) for piece in pieces[host_pages[i]]]
            reason = self.codec.decode_page(keys[i], ios[i].header, stored, out)
            return reason, time.perf_counter() - t0

        good, why, seconds = len(keys), None, 0.0
        for i, (reason, t) in enumerate(list(self._map(decode, len(keys)))):  # every task done before we return
            seconds += t
            if reason is not None and why is None:
                good, why = i, reason
        counts = {
            "decoded_pages": good, "decoded_logical_bytes": good * self.codec.payload_bytes,
            "decoded_stored_bytes": sum(sizes[:good]) - good * HEADER_BYTES, "decode": seconds,
            "failed_pages": 1 if why is not None else 0,
        }
        return good, why, counts

    def _count(self, counts: dict[str, Any]) -> None:
        for name, value in counts.items():
            if name in self._codec_seconds:
                self._codec_seconds[name] += value
            else:
                self._codec_counts[name] += value

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

    # -- markers ------------------------------------------------------------------------------

    async def mark(self, key: bytes) -> bool:
        """Store a marker under ``key`` (a page-key-like 16 bytes, named as pages are): a
        header-sized object whose presence is the whole message (a producer that gave up a
        hand-off, ``integrations/vllm/handoff.py``). No lookup reads it; ``exists`` sees it.
        False where the backend did not store it (counted as any failed write)."""
        if not self._enter():
            return False
        try:
            return await self._set(self.codec.storage_keys([key]), [PageIO.of(bytes(HEADER_BYTES))]) == 1
        finally:
            self._exit()

    async def has_mark(self, key: bytes) -> bool:
        """Whether a marker (``mark``) is stored under ``key``."""
        return await self.exists([key]) == 1

    async def unmark(self, key: bytes) -> None:
        """Remove the marker under ``key`` (nothing where there is none)."""
        if self._enter():
            try:
                await self._drop(self.codec.storage_keys([key])[0])
            finally:
                self._exit()

    async def fetch(
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        on_batch: Callable[[int, int], bool] | None = None,
        *,
        source: PageSource | None = None,
        sliding_from: int = 0,
    ) -> int:
        """Read pages ``keys`` into ``host_pages`` (allocated, not yet published) of the host pool
        (or of ``source``); verified count.

        Batches are pipelined: the next batch is read while this one is verified, and each page's
        check starts as soon as the backend reports it landed. After each
        batch, ``on_batch(first, good)`` may publish its ``good`` verified pages (indices
        ``first..first+good`` of ``host_pages``) and return False to stop. Pages past the returned
        count hold garbage and are the caller's to free. A page that fails verification is counted
        as corrupt and deleted from the backend, so a later ``store`` writes the page again.
        ``sliding_from``: for a tier with ``window_pages`` (pages before it may come back thin);
        whole pages come back whole.
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
        coded = self.codec.encoded
        send, receive = anyio.create_memory_object_stream[
            tuple[int, list[PageIO], int, list[int], BatchChecks | None]
        ](1)
        held: list[np.ndarray] = []  # staging arenas of this call, back to the pool at the end
        started: list[BatchChecks] = []  # checks of this call, every one waited for before it returns

        async def read_ahead() -> None:
            async with send:
                for first in starts:
                    k = keys[first : first + self.batch_pages]
                    sizes: list[int] = []
                    checks = None
                    if coded:
                        arena = self._take_arena(len(k))
                        held.append(arena)
                        ios = self._staging_ios(arena, len(k))
                        sizes = [0] * len(k)
                    else:
                        ios, checks = self._checked_ios(k, host_pages[first : first + self.batch_pages], source)
                        started.append(checks)
                    try:
                        n = await self.backend.get(k, ios, sizes=sizes) if coded else await self.backend.get(k, ios)
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
                    if checks is not None:
                        checks.finish(n)  # those the backend did not report as landed
                    await send.send((first, ios, n, sizes, checks))
                    if n < len(k):
                        return

        # The reader's threads write into host_pages (and the staging arenas): the group waits for
        # them before returning, even when cancelled, so the caller never frees a page that is
        # still being written.
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read_ahead)
                async with receive:
                    async for first, ios, n, sizes, checks in receive:
                        k = keys[first : first + len(ios)]
                        if checks is None:  # through the codec chain: check, then decode
                            good, reason, counts = await anyio.to_thread.run_sync(
                                self._verify, k[:n], ios[:n], sizes[:n], host_pages[first : first + n], source
                            )
                            self._count(counts)
                        elif checks.pooled and checks.settled():
                            good, reason = checks.result(n)  # checked while the batch landed: no hop
                        else:
                            good, reason = await anyio.to_thread.run_sync(checks.result, n)
                        total += good
                        self.fetched_pages += good
                        if reason is not None:
                            await self._drop_corrupt(k[good], reason)
                        go_on = on_batch(first, good) if on_batch is not None else True
                        if good < len(k) or not go_on:
                            tg.cancel_scope.cancel()
                            break
        finally:
            for arena in held:
                self._give_arena(arena)
            busy = [checks for checks in started if not checks.settled()]
            if busy:  # a cancelled or failed fetch: its checks still read host pages the caller will free
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(lambda: [checks.drain() for checks in busy])
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
        self,
        keys: Sequence[bytes],
        host_pages: Sequence[int],
        *,
        source: PageSource | None = None,
        sliding: Sequence[bool] | None = None,
    ) -> int:
        """Write ``host_pages`` (pinned by the caller) of the host pool (or of ``source``) under
        ``keys``; consecutive pages stored. ``sliding``: for a tier with ``window_pages`` (the
        pages whose sliding layers it keeps); whole pages are stored whole.

        Headers (checksums or MACs) are sealed by the backend's writer threads page by page, or
        (backends that do not seal, codec chains) those of the next batch are encoded on the codec
        threads while this batch is written, so a MAC's CPU time runs beside the backend's I/O.
        """
        assert len(keys) == len(host_pages)
        if not self._enter():
            return 0
        try:
            done = await self._store(keys, host_pages, source)
        finally:
            self._exit()
        if done and self.stored_hook is not None:
            self.stored_hook(self.name, keys[:done], self.codec.storage_keys(keys[:done]))
        return done

    async def _store(
        self, keys: Sequence[bytes], host_pages: Sequence[int], source: PageSource | None = None
    ) -> int:
        keys = self.codec.storage_keys(keys)
        step = self.batch_pages
        starts = range(0, len(keys), step)
        total = 0
        if type(self.backend).seals_pages and not self.codec.encoded:
            # The backend's writer threads seal each page (its checksum or MAC) just before writing
            # it: no encoding stage, no hop of its own, and the page is read twice back to back.
            for start in starts:
                k = keys[start : start + step]
                n = await self._set(k, self._page_ios(host_pages[start : start + step], source, seal_keys=k))
                if n < 0:
                    return total
                total += n
                self.stored_pages += n
                if n < len(k):
                    break
            return total
        encoded: dict[int, list[PageIO]] = {}

        async def encode(start: int) -> None:
            encoded[start], counts = await anyio.to_thread.run_sync(
                self._encode, keys[start : start + step], host_pages[start : start + step], source
            )
            self._count(counts)

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
                n = await self._set(k, ios)
            if n < 0:
                return total
            total += n
            self.stored_pages += n
            if n < len(k):
                break
        return total

    async def _set(self, keys: Sequence[bytes], ios: list[PageIO]) -> int:
        """One backend ``set``: pages stored from the first, or -1 when it failed (counted)."""
        try:
            n = await self.backend.set(keys, ios)
        except StorageError as exc:
            self._failed(exc)
            return -1
        self._succeeded()
        return n

    def _failed(self, exc: StorageError) -> None:
        # One warning when the tier starts failing, not one per request while it stays down.
        self.failures += 1
        if self._healthy:
            self._healthy = False
            self.backend._removed(None)  # its pages cannot be promised until it answers again
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
            codec=CodecStats(
                stages=self.codec.chain.names, encode_seconds=self._codec_seconds["encode"],
                decode_seconds=self._codec_seconds["decode"], **self._codec_counts,
            ),
        )

    def __repr__(self) -> str:
        return f"<StorageTier {self.name} {self.backend!r}>"
