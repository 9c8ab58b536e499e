"""Attaching and detaching storage tiers while the cache runs.

The controller's ``storage`` list is shared by the storage writer, the prefetcher and the residency
rule; it is only ever changed here, in place, in one synchronous step, so every reader sees either
the old chain or the new one. Readers that await take a snapshot of it (a probe, a write), and a
tier that leaves the list is marked ``detached`` before it is closed, so a snapshot that still holds
it sees misses, never an error. Requests in flight therefore see a shorter chain, never an error.

**Attach** opens the tier first (a tier that cannot open changes nothing), then inserts it at
``position`` (the end by default). Pages already written to the other tiers are not copied to it
(no backfill): it receives what the write policy writes from then on, and pages still in memory
that were never written to storage are written to it when they would leave memory.

**Detach** takes the tier out of the list at once (no new probe, write or prefetch uses it), then:

* ``drain=True``: waits, at most ``timeout_s``, for the writes and prefetches that already include
  it to finish; ``drain=False`` (or the timeout) cancels those prefetches (what arrived stays cached,
  the request gets a shorter prefix) and lets those writes skip it;
* waits for the backend calls in flight (each bounded by the tier's ``timeout_s``), then closes it;
* forgives failed writes (``store_failed``): a failure may have been this tier's, and a page must
  never be counted lost for a tier that is gone, so those pages are owed again to the tiers that
  remain (and, with none left, to nothing: they may leave memory freely);
* with no tier left, waits for the queued writes to be released, so no node stays ``storing``.

Pages the write policy promised to the remaining tiers are untouched: a page already written was
written to every tier of its write's snapshot, and pages still owed are written to what remains.

The controller owns the chain (built when it opens) and hands it what it changes and waits on; this
module never names the controller.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio

from ..errors import ConfigError, InvalidRequestError
from ..radix_tree import HiRadixTree
from ..tiers.host import HostPool
from ..tiers.storage.tier import StorageTier
from .jobs import JobTracker
from .prefetch import Prefetcher
from .storage_writer import StorageWriter

__all__ = ["StorageChain", "StorageChange"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageChange:
    """What an attach or detach did."""

    action: str  # "attached" | "detached"
    name: str
    kind: str
    position: int  # its place in the chain (before it left, for a detach)
    chain: tuple[str, ...]  # the storage tiers after the change, fastest first
    seconds: float
    drained_writes: int = 0  # writes in flight that included the tier (detach)
    drained_prefetches: int = 0  # prefetches reading from it when it left (detach)
    cancelled_prefetches: int = 0  # of those, cancelled (drain=False, or the timeout)
    retried_pages: int = 0  # pages whose failed write is owed again to the remaining tiers


class StorageChain:
    """Changes the controller's live list of storage tiers (``storage``), one change at a time.

    ``check_open`` raises once the cache is closing; ``start_storage_worker`` starts the storage
    worker if no tier was configured at open; ``close_with_cache`` closes an attached tier with the
    cache; ``storage_jobs`` counts queued writes; ``default_timeout_s`` bounds a detach's drain.
    """

    def __init__(
        self,
        storage: list[StorageTier],
        *,
        host: HostPool,
        tree: HiRadixTree,
        writer: StorageWriter,
        prefetcher: Prefetcher,
        storage_jobs: JobTracker,
        check_open: Callable[[], None],
        start_storage_worker: Callable[[], Awaitable[None]],
        close_with_cache: Callable[[StorageTier], None],
        default_timeout_s: float,
    ) -> None:
        self.storage = storage
        self.host = host
        self.tree = tree
        self.writer = writer
        self.prefetcher = prefetcher
        self.storage_jobs = storage_jobs
        self.check_open = check_open
        self.start_storage_worker = start_storage_worker
        self.close_with_cache = close_with_cache
        self.default_timeout_s = default_timeout_s
        self._lock = anyio.Lock()  # one change at a time

    async def attach(self, tier: StorageTier, position: int | None = None) -> StorageChange:
        storage = self.storage
        self.check_open()
        async with self._lock:
            started = anyio.current_time()
            taken = {"device", "host"} | {t.name for t in storage}
            if tier.name in taken:
                raise ConfigError(
                    f"storage tier name {tier.name!r} is taken (tiers now: {', '.join(sorted(taken))}): "
                    "give the entry a distinct `name`"
                )
            if self.host.num_pages == 0:
                raise ConfigError("storage tiers are written and read through the host tier, and this cache has none")
            where = len(storage) if position is None else position
            if isinstance(where, bool) or not isinstance(where, int) or not 0 <= where <= len(storage):
                raise InvalidRequestError(
                    f"position must be an int in [0, {len(storage)}] (0: fastest) or None (the end), got {position!r}"
                )
            with anyio.CancelScope(shield=True):  # never leave a half-open backend behind
                try:
                    await tier.__aenter__()
                    self.check_open()  # the cache may have started closing while the backend opened
                except BaseException:
                    await tier.__aexit__(None, None, None)
                    raise
                await self.start_storage_worker()
                storage.insert(where, tier)
                self.close_with_cache(tier)
            change = StorageChange(
                "attached", tier.name, tier.backend.kind, where, tuple(t.name for t in storage),
                anyio.current_time() - started,
            )
        log.info("storage tier %s (%s) attached at position %d; chain now: %s (%.3f s)",
                 change.name, change.kind, where, " > ".join(change.chain), change.seconds)
        return change

    async def detach(self, name: str, *, drain: bool = True, timeout_s: float | None = None) -> StorageChange:
        storage, writer, prefetcher = self.storage, self.writer, self.prefetcher
        self.check_open()
        timeout = self.default_timeout_s if timeout_s is None else timeout_s
        async with self._lock:
            started = anyio.current_time()
            names = [t.name for t in storage]
            if name not in names:
                raise InvalidRequestError(
                    f"no storage tier named {name!r} is attached (attached: {', '.join(names) or 'none'})"
                )
            position = names.index(name)
            tier = storage[position]
            del storage[position]  # from here no new probe, write or prefetch reaches it
            writes = writer.writing_to(tier)
            prefetches = prefetcher.using(tier)
            cancelled = 0
            # Shielded, and bounded below: a cancelled caller must not leave a tier half detached.
            with anyio.CancelScope(shield=True):
                if drain:
                    with anyio.move_on_after(timeout):
                        for op in prefetches:
                            await op.wait()
                        await writer.wait_writes_to(tier)
                tier.detached = True  # calls not yet started are misses; writes skip it
                left = prefetcher.using(tier)
                for op in left:
                    op.cancel()
                    cancelled += 1
                for op in {id(op): op for op in [*prefetches, *left]}.values():
                    await op.wait()
                await writer.wait_writes_to(tier)
                await tier.wait_idle()
                await tier.__aexit__(None, None, None)
                retried = self._forgive_failed_writes()
                if not storage:
                    with anyio.move_on_after(timeout):
                        await self.storage_jobs.wait_idle()  # queued writes find no tier: released
            change = StorageChange(
                "detached", tier.name, tier.backend.kind, position, tuple(t.name for t in storage),
                anyio.current_time() - started, drained_writes=writes, drained_prefetches=len(prefetches),
                cancelled_prefetches=cancelled, retried_pages=retried,
            )
        log.info(
            "storage tier %s (%s) detached (drain=%s): %d writes and %d prefetches were using it, %d cancelled, "
            "%d pages with a failed write owed again; chain now: %s (%.3f s)",
            change.name, change.kind, drain, writes, len(prefetches), cancelled, retried,
            " > ".join(change.chain) or "no storage", change.seconds,
        )
        return change

    def _forgive_failed_writes(self) -> int:
        pages = 0
        for node in self.tree.nodes():
            if node.store_failed:
                node.store_failed = False
                pages += node.num_pages
        return pages
