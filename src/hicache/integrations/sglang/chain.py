"""hicache's storage tiers as SGLang's L3: one chain of ``StorageTier``s, bounded calls, counted failures.

SGLang asks three things of its storage backend, each for at most 128 consecutive pages of one
prefix: how many are there (``exists``), read them into host slots (``fetch``), write them from host
slots (``store``). ``StorageChain`` answers them over hicache's tiers, fastest first:

* ``exists``: the longest run any tier holds (pages are chained, so a run from the start);
* ``fetch``: from the first tier, then what it lacked from the next, and so on; every page verified
  (``StorageTier``: header, checksum or MAC, name) before it counts;
* ``store``: to every tier, skipping the pages a tier already holds; stored means stored in all.
  A rank that does not write shared storage (``Namespace.writes_storage``: MLA ranks but 0) writes
  nothing and answers as stored: the writing rank stores those bytes.

Every call is bounded by ``timeout_s``: it stops there, and what was verified by then is reported
(a read) or nothing is (a write). Backend failures are misses the tiers count; anything else that
goes wrong is logged, counted in ``failed_calls`` and answered as a miss: SGLang's threads never
see an exception. A read never returns while a thread still writes into the pool (the tier waits
for its threads even when cancelled), so a timed-out page's slots are never written after SGLang
takes them back.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Sequence
from contextlib import AsyncExitStack
from types import MappingProxyType

import anyio

from ...logs import RateLimited
from ...stats import TRANSFER_DIRECTIONS, CacheStats, LatencyHistogram
from ...tiers.storage.tier import PageSource, StorageTier
from .clear import TierCleared, clear_tiers

__all__ = ["CallRecord", "StorageChain"]

log = logging.getLogger("hicache.sglang")

_RECORDS = 4096  # per-call records kept for SGLang's get_stats() between two of its reads


@dataclasses.dataclass(frozen=True)
class CallRecord:
    """One read or write call: pages moved and how long it took (for SGLang's storage metrics)."""

    pages: int
    seconds: float
    nbytes: int

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class StorageChain:
    def __init__(
        self, tiers: Sequence[StorageTier], *, page_size: int, page_bytes: int, writes: bool, timeout_s: float
    ) -> None:
        self.tiers = list(tiers)
        self.page_size = page_size
        self.page_bytes = page_bytes
        self.writes = writes
        self.timeout_s = timeout_s
        self._stack: AsyncExitStack | None = None
        # counters (touched on the event loop only)
        self.lookups = self.retrieves = self.stores = 0
        self.fetched_pages = self.stored_pages = self.present_pages = self.not_writer_pages = 0
        self.timeouts = self.failed_calls = 0
        self.bytes_moved = dict.fromkeys(TRANSFER_DIRECTIONS, 0)
        # Named as the cache's (``stats.LATENCIES``): a read from storage is a prefetch's wait.
        self.latency = {name: LatencyHistogram() for name in ("lookup", "prefetch_wait", "store")}
        self.reads: deque[CallRecord] = deque(maxlen=_RECORDS)
        self.writes_done: deque[CallRecord] = deque(maxlen=_RECORDS)
        self._warn = RateLimited(log)

    # -- lifecycle ------------------------------------------------------------------------------

    async def open(self) -> None:
        stack = AsyncExitStack()
        try:
            for tier in self.tiers:
                await stack.enter_async_context(tier)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stack.aclose()
            raise
        self._stack = stack

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            with anyio.move_on_after(self.timeout_s, shield=True):
                await stack.aclose()

    async def clear(self, scope: str) -> list[TierCleared]:
        """SGLang's clear, as far as ``scope`` reaches (``clear.py``)."""
        return await clear_tiers(self.tiers, scope, writes=self.writes)

    # -- SGLang's three questions ---------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> int:
        self.lookups += 1
        start = time.perf_counter()
        found = 0
        with anyio.move_on_after(self.timeout_s) as scope:
            for tier in self.tiers:
                found = max(found, await tier.exists(keys))
                if found == len(keys):
                    break
        if scope.cancelled_caught:
            self._timed_out("exists", len(keys))
            found = 0
        self.latency["lookup"].observe(time.perf_counter() - start)
        return found

    async def fetch(self, keys: Sequence[bytes], pages: Sequence[int], source: PageSource) -> int:
        """Read ``keys`` into ``pages`` of ``source``; how many consecutive pages are verified there."""
        self.retrieves += 1
        start = time.perf_counter()
        done = 0  # pages verified in place so far, also when the deadline cuts a tier's read short

        with anyio.move_on_after(self.timeout_s) as scope:
            for tier in self.tiers:
                if done == len(keys):
                    break
                offset = done

                def landed(first: int, good: int, offset: int = offset) -> bool:
                    nonlocal done
                    done = offset + first + good
                    return True

                got = await tier.fetch(keys[offset:], pages[offset:], landed, source=source)
                done = offset + got
                tier.hit_tokens += got * self.page_size
                tier.miss_tokens += (len(keys) - done) * self.page_size
        if scope.cancelled_caught:
            self._timed_out("read", len(keys))
        elapsed = time.perf_counter() - start
        self.fetched_pages += done
        self.bytes_moved["storage_to_host"] += done * self.page_bytes
        self.latency["prefetch_wait"].observe(elapsed)
        self.reads.append(CallRecord(done, elapsed, done * self.page_bytes))
        return done

    async def store(self, keys: Sequence[bytes], pages: Sequence[int], source: PageSource) -> int:
        """Write ``pages`` of ``source`` under ``keys`` to every tier; pages now held by all of them."""
        self.stores += 1
        if not self.writes:
            self.not_writer_pages += len(keys)
            return len(keys)
        start = time.perf_counter()
        held = len(keys)
        written = 0
        with anyio.move_on_after(self.timeout_s) as scope:
            for tier in self.tiers:
                have = await tier.exists(keys)
                tier.skipped_pages += have
                n = await tier.store(keys[have:], pages[have:], source=source) if have < len(keys) else 0
                self.present_pages += have
                written += n
                held = min(held, have + n)
        if scope.cancelled_caught:
            self._timed_out("write", len(keys))
            held = 0
        elapsed = time.perf_counter() - start
        self.stored_pages += written
        self.bytes_moved["host_to_storage"] += written * self.page_bytes
        self.latency["store"].observe(elapsed)
        self.writes_done.append(CallRecord(written, elapsed, written * self.page_bytes))
        return held

    def _timed_out(self, what: str, pages: int) -> None:
        self.timeouts += 1
        self._warn.warning(
            what, "hicache: a %s of %d pages ran past timeout_s=%ss; answered as a miss (%d timeouts so far)",
            what, pages, self.timeout_s, self.timeouts,
        )

    # -- observability --------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """A ``CacheStats`` of the storage tiers (SGLang owns device and host memory: no memory tiers);
        ``hicache.metrics.HiCacheCollector`` reads it like a cache's."""
        return CacheStats(
            tiers=MappingProxyType({}),
            bytes_moved=MappingProxyType(dict(self.bytes_moved)),
            lookups=self.lookups,
            retrieves=self.retrieves,
            stores=self.stores,
            stored_pages=self.stored_pages,
            dropped_pages=0,
            backups=0,
            backups_skipped=self.not_writer_pages,
            spills=0,
            loads=0,
            queue_depths=MappingProxyType({}),
            in_flight=0,
            storage=MappingProxyType(
                {tier.name: dataclasses.replace(tier.stats(), position=i) for i, tier in enumerate(self.tiers)}
            ),
            prefetched_pages=self.fetched_pages,
            storage_backups=self.stored_pages,
            latencies=MappingProxyType({name: h.snapshot() for name, h in self.latency.items()}),
        )
