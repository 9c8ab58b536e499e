"""Page allocation with eviction, for both memory tiers.

Device eviction takes device *leaves* (no device-resident child) in policy order, skipping anything
pinned or in flight, so device residency stays prefix-closed. A victim without a host copy is
spilled to host first when the write policy says so (write-back) or when it still has children
(dropping it would orphan them); otherwise it is simply dropped. The spill copy runs in a worker
thread, so the event loop is never blocked by eviction.

Host eviction drops host-only leaves first (the node leaves the tree), then host copies of nodes
that are still on the device. Under write-back with storage tiers, a host-only victim that was never
written to storage is written first (a spill, batched, in worker threads); otherwise host eviction
is bookkeeping only. Pages being written to storage (``storing``) are never evicted from the host.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Awaitable, Callable

import anyio

from ..errors import CapacityError
from ..io.transfer import TransferEngine
from ..policies.base import EvictionPolicy, WritePolicy
from ..radix_tree import HiRadixTree, Pin, TreeNode
from ..stats import Counters
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from .storage_writer import StorageWriter

__all__ = ["Evictor"]

log = logging.getLogger(__name__)


class Evictor:
    def __init__(
        self,
        tree: HiRadixTree,
        device: DevicePool,
        host: HostPool,
        engine: TransferEngine,
        eviction_policy: EvictionPolicy,
        write_policy: WritePolicy,
        counters: Counters,
        limiter: anyio.CapacityLimiter,
        on_device_alloc: Callable[[], None] = lambda: None,
        backups_in_flight: Callable[[], int] = lambda: 0,
        wait_backups: Callable[[], Awaitable[None]] | None = None,
        storage_writer: StorageWriter | None = None,
        on_host_copy: Callable[[TreeNode], Awaitable[None]] | None = None,
    ) -> None:
        self.tree = tree
        self.device = device
        self.host = host
        self.engine = engine
        self.policy = eviction_policy
        self.write_policy = write_policy
        self.counters = counters
        self.limiter = limiter
        self.on_device_alloc = on_device_alloc
        self.backups_in_flight = backups_in_flight
        self.wait_backups = wait_backups or anyio.lowlevel.checkpoint
        self.storage_writer = storage_writer
        self.on_host_copy = on_host_copy
        self._device_lock = anyio.Lock()
        self._host_lock = anyio.Lock()  # taken inside _device_lock (a device spill allocates host), never around it

    # -- allocation -----------------------------------------------------------------------------

    async def alloc_device(self, n: int, *, partial: bool = False) -> list[int]:
        """Allocate ``n`` device pages, evicting as needed.

        With ``partial=True`` returns as many as could be freed (maybe none); otherwise raises
        ``CapacityError`` when ``n`` pages cannot be had.
        """
        for _ in range(3):  # pages freed during a spill may be taken by another task; retry
            short = n - self.device.free_pages
            if short <= 0:
                break
            if await self.evict_device(short) >= short:
                continue  # re-check: another task may have taken pages while we spilled
            if not self.backups_in_flight():
                break  # everything else is leased or in flight: give what there is
            # Pages still being backed up become evictable (for free) once their copy is done:
            # waiting for it beats truncating a retrieve or dropping a store.
            await self.wait_backups()
        k = min(n, self.device.free_pages) if partial else n
        pages = self.device.allocator.allocate(k)
        if pages:
            self.on_device_alloc()
        return pages

    async def alloc_host(self, n: int, *, partial: bool = False) -> list[int]:
        """Allocate ``n`` host pages, evicting as needed (write-back may spill to storage first)."""
        short = n - self.host.free_pages
        if short > 0:
            await self.evict_host(short)
        k = min(n, self.host.free_pages) if partial else n
        return self.host.allocator.allocate(k)

    # -- device ---------------------------------------------------------------------------------

    def _device_candidate(self, node: TreeNode) -> bool:
        return node.device is not None and node.evictable and not node.has_device_child()

    async def evict_device(self, n_pages: int) -> int:
        """Free at least ``n_pages`` device pages if possible; return how many were freed."""
        async with self._device_lock:
            heap = [(self.policy.key(nd), nd.id, nd) for nd in self.tree.nodes() if self._device_candidate(nd)]
            heapq.heapify(heap)
            freed = 0
            while freed < n_pages and heap:
                _, _, node = heapq.heappop(heap)
                if not self._device_candidate(node):
                    continue  # changed while we awaited a spill
                if node.host is None and (self.write_policy.spill_on_evict or node.children):
                    await self._spill(node)
                    if not self._device_candidate(node):
                        continue  # leased or loaded into while spilling: keep it
                    if node.host is None and node.children:
                        continue  # host full of pinned pages: cannot drop a node with children
                pages = node.device
                assert pages is not None
                node.device = None
                self.device.allocator.free(pages)
                freed += len(pages)
                self.counters.evicted_pages["device"] += len(pages)
                parent = node.parent
                if node.host is None:
                    self.tree.remove(node)
                if parent is not None and parent is not self.tree.root and self._device_candidate(parent):
                    heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
            return freed

    async def _spill(self, node: TreeNode) -> None:
        """Copy ``node``'s device pages to new host pages (write-back, or to keep its children)."""
        try:
            host_pages = await self.alloc_host(node.num_pages)
        except CapacityError:
            log.debug("no host room to spill %r", node)
            return
        device_pages = list(node.device or [])
        keys = list(node.keys)
        pin = Pin(node)
        node.backing_up = True
        done = False
        try:
            await anyio.to_thread.run_sync(self.engine.device_to_host, device_pages, host_pages, limiter=self.limiter)
            done = True
        finally:
            for covered, start, end in self.tree.covering(node, keys):
                covered.backing_up = False
                if done:
                    covered.host = host_pages[start:end]
            if not done:
                self.host.allocator.free(host_pages)
            pin.release()
        self.counters.spills += len(host_pages)
        self.counters.bytes_moved["device_to_host"] += len(host_pages) * self.device.geometry.page_bytes
        if self.on_host_copy is not None:
            for covered, _, _ in self.tree.covering(node, keys):
                await self.on_host_copy(covered)

    # -- host -----------------------------------------------------------------------------------

    def _spills_to_storage(self, node: TreeNode) -> bool:
        w = self.storage_writer
        return w is not None and self.write_policy.spill_on_evict and w.wanted(node)

    async def evict_host(self, n_pages: int) -> int:
        """Drop at least ``n_pages`` host pages if possible; return how many were dropped."""
        async with self._host_lock:
            freed = 0
            while freed < n_pages:
                dropped, spilled = await self._evict_host_leaves(n_pages - freed)
                freed += dropped
                if not dropped and not spilled:
                    break
            if freed < n_pages:
                freed += self._drop_host_mirrors(n_pages - freed)
            self.counters.evicted_pages["host"] += freed
            return freed

    @staticmethod
    def _host_only_leaf(nd: TreeNode) -> bool:
        return nd.host is not None and nd.device is None and not nd.children and nd.evictable and not nd.storing

    async def _evict_host_leaves(self, n_pages: int) -> tuple[int, bool]:
        """One round: drop host-only leaves in policy order; spill those that need it first.

        Returns ``(pages dropped, whether anything was spilled)``; spilled nodes that became
        evictable are dropped in the same round, and their parents are candidates for the next.
        """
        heap = [(self.policy.key(nd), nd.id, nd) for nd in self.tree.nodes() if self._host_only_leaf(nd)]
        heapq.heapify(heap)
        freed = 0
        to_spill: list[TreeNode] = []
        pending = 0
        while freed + pending < n_pages and heap:
            _, _, node = heapq.heappop(heap)
            if not self._host_only_leaf(node):
                continue
            if self._spills_to_storage(node):
                to_spill.append(node)
                pending += node.num_pages
                continue
            parent = node.parent
            freed += self._drop_host_node(node)
            if parent is not None and parent is not self.tree.root and self._host_only_leaf(parent):
                heapq.heappush(heap, (self.policy.key(parent), parent.id, parent))
        if to_spill:
            await self._spill_to_storage(to_spill)
            for node in to_spill:
                if node.parent is not None and self._host_only_leaf(node):
                    freed += self._drop_host_node(node)
        return freed, bool(to_spill)

    def _drop_host_node(self, node: TreeNode) -> int:
        pages = node.host
        assert pages is not None
        node.host = None
        self.host.allocator.free(pages)
        self.tree.remove(node)
        return len(pages)

    async def _spill_to_storage(self, nodes: list[TreeNode]) -> None:
        """Write-back at the host -> storage boundary: write the victims before they are dropped."""
        writer = self.storage_writer
        assert writer is not None
        jobs = [writer.prepare(nd) for nd in nodes]
        results = [False] * len(jobs)
        try:
            results = await writer.write(jobs)
        finally:
            for job, ok in zip(jobs, results, strict=True):
                writer.finish(job, ok)
        self.counters.spills_to_storage += sum(len(j.keys) for j, ok in zip(jobs, results, strict=True) if ok)

    def _drop_host_mirrors(self, n_pages: int) -> int:
        """Second choice: host copies of pages still on the device (the device copy stays)."""
        mirrored = [
            (self.policy.key(nd), nd.id, nd)
            for nd in self.tree.nodes()
            if nd.host is not None and nd.device is not None and nd.evictable and not nd.storing
        ]
        heapq.heapify(mirrored)
        freed = 0
        while freed < n_pages and mirrored:
            _, _, node = heapq.heappop(mirrored)
            pages = node.host
            assert pages is not None
            node.host = None
            self.host.allocator.free(pages)
            freed += len(pages)
        return freed
