"""Page allocation with eviction, for both memory tiers.

Victims are chosen in eviction-policy order among unpinned nodes that no transfer is reading or
filling; whether a victim may go is the residency rule's call (``residency.py``), the same for
both tiers:

* the device takes device *leaves* (no device-resident child), so device residency stays
  prefix-closed. A victim the write policy promised to the host and that has no host copy yet is
  spilled there first (batched, one copy in a worker thread); one whose backup is in flight waits.
  Pages move by runs, not whole nodes: a victim larger than the host room it gets is split, and
  its last pages (a run that fits) are spilled and leave the device; the rest stays a device leaf
  for the next round. So a page can leave the device as soon as one page of host room can be had,
  however large its node (a node larger than the whole host tier leaves it run by run).
* a compact host (``tiers/shed.py``) first sheds: host-only nodes drop the sliding layers of
  their pages before the window and slack their end keeps (``shed_keep``), in policy order, as the
  residency rule allows (``may_shed``). Synchronous, no copy: memory is simply given back.
* the host takes host-only leaves first (the node leaves the tree), then host copies of nodes that
  are still on the device. A victim promised to storage and not written there yet is written first
  (batched, through the storage writer); one whose write is queued or in flight waits; one whose
  write failed goes, counted in ``lost_pages``.

Victims come from candidate heaps kept up to date as nodes change (``candidates.py``), so a round
costs O(log n) per victim, not a pass over the tree, and a large eviction (the watermark worker's)
yields to the event loop every few hundred victims; the pages callers hold under leases are counted
by the tree as pins come and go (``HiRadixTree.leased_pages``).

Leases may pin host-only pages (a prefetch's, a retrieve's until its load-back), but never the
last ``spill_room`` of the host (``pin_room``, ``wait_pin_room``): that room is how device pages
owed to the host leave, so a device full of such pages can always make room for the very load-back
a pin waits for.

When no victim is left to take, allocation waits for in-flight jobs that may make room (copies down,
load-backs, stores publishing their pages), one completion at a time, at most
``controller.alloc_wait_s`` (``BoundedWait``): that wait is the backpressure a ``store`` feels from a
slow lower tier, counted in ``eviction_waits``. It gives up when nothing is in flight any more:
everything else is leased.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

import anyio
import anyio.lowlevel

from ..io.transfer import TransferEngine
from ..policies.base import EvictionPolicy
from ..radix_tree import HiRadixTree, Pin, TreeNode
from ..stats import Counters
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from .candidates import (
    DEVICE_LEAF, HOST_LEAF, HOST_MIRROR, HOST_SHED, Candidates, device_leaf, host_leaf, host_mirror,
)
from .jobs import BoundedWait, JobTracker
from .residency import Residency, Verdict
from .storage_writer import StorageWriter

__all__ = ["Evictor"]

log = logging.getLogger(__name__)

_YIELD_EVERY = 256  # victims examined between checkpoints: a bulk eviction never holds the loop long


def spill_room(host_pages: int) -> int:
    """Host pages that pins leave to pages coming down from the device (an eighth, at least one).

    A lease pins host-only pages (a prefetch's until a retrieve takes them, a retrieve's until its
    load-back is done); were the whole host pinned so, the device could not spill (pages owed to
    the host stay), and a retrieve waiting for device room to load its pinned pages would wait in
    vain. Pages leave tiers by runs, so one page that can be had is enough for the device to make
    progress; an eighth keeps those runs from being tiny.
    """
    return min(max(1, host_pages // 8), max(host_pages - 1, 0))


class Evictor:
    def __init__(
        self,
        tree: HiRadixTree,
        device: DevicePool,
        host: HostPool,
        engine: TransferEngine,
        eviction_policy: EvictionPolicy,
        residency: Residency,
        counters: Counters,
        limiter: anyio.CapacityLimiter,
        *,
        frees_device: JobTracker,
        frees_host: JobTracker,
        alloc_wait_s: float = 30.0,
        on_device_alloc: Callable[[], None] = lambda: None,
        storage_writer: StorageWriter | None = None,
        on_host_copy: Callable[[TreeNode], Awaitable[None]] | None = None,
        shed_keep: int | None = None,
    ) -> None:
        """``shed_keep``: pages at each node's end whose sliding layers a compact host keeps (the
        window and its slack); None: the host never sheds."""
        self.tree = tree
        self.device = device
        self.host = host
        self.engine = engine
        self.policy = eviction_policy
        self.residency = residency
        self.counters = counters
        self.limiter = limiter
        self.frees_device = frees_device  # jobs whose end can make device pages evictable
        self.frees_host = frees_host  # jobs whose end can make host pages evictable
        self.alloc_wait_s = alloc_wait_s
        self.on_device_alloc = on_device_alloc
        self.storage_writer = storage_writer
        self.on_host_copy = on_host_copy
        self.shed_keep = shed_keep if host.compact else None
        self.candidates = Candidates(tree, eviction_policy, shed_keep=self.shed_keep)
        self._device_lock = anyio.Lock()
        self._host_lock = anyio.Lock()  # taken inside _device_lock (a device spill allocates host), never around it

    # -- allocation -----------------------------------------------------------------------------

    def _waiter(self, tracker: JobTracker) -> BoundedWait:
        def waited(seconds: float) -> None:
            self.counters.eviction_waits += 1
            self.counters.eviction_wait_s += seconds

        return BoundedWait(tracker, self.alloc_wait_s, waited)

    # -- pins on the host ------------------------------------------------------------------------

    def pin_room(self) -> int:
        """Host pages that leases may still pin (host-only pages: a prefetch's, a retrieve's before
        its load-back) while the host keeps ``spill_room`` for pages leaving the device."""
        n = self.host.capacity_pages
        return n - spill_room(n) - self.tree.leased_pages["host"]

    async def wait_pin_room(self, reserved: Callable[[], int] = lambda: 0) -> int:
        """``pin_room()`` less what the caller has ``reserved`` and not pinned yet; while that is
        none, wait for the jobs that unpin or free host pages (a load-back takes a retrieve's pages
        to the device), bounded as an allocation's wait. 0: there is none to be had."""
        waits = self.host_waiter()
        while (room := self.pin_room() - reserved()) <= 0:
            if not await waits.next():
                return 0
        return room

    def host_waiter(self) -> BoundedWait:
        """A bounded wait for the jobs that can free or unpin host pages (not an eviction wait:
        ``eviction_waits`` counts what allocations wait)."""
        return BoundedWait(self.frees_host, self.alloc_wait_s)

    async def alloc_device(self, n: int, *, partial: bool = False) -> list[int]:
        """Allocate ``n`` device pages, evicting as needed.

        With ``partial=True`` returns as many as could be had (maybe none); otherwise raises
        ``CapacityError`` when ``n`` pages cannot be had.
        """
        waits = self._waiter(self.frees_device)
        self.candidates.refresh()  # keep the queues current: each call pays for what changed since
        while n > self.device.free_pages:
            short = n - self.device.free_pages
            if await self.evict_device(short) >= short:
                continue  # re-check: another task may have taken pages meanwhile
            if self.device.free_pages >= min(n, self._unleased("device")) or not await waits.next():
                break  # the rest is leased, or nothing in flight can free it: give what there is
        k = min(n, self.device.free_pages) if partial else n
        pages = self.device.allocator.allocate(k)
        if pages:
            self.on_device_alloc()
        return pages

    async def alloc_host(self, n: int, *, partial: bool = False) -> list[int]:
        """Allocate ``n`` host pages, evicting as needed (writing promised pages to storage first)."""
        waits = self._waiter(self.frees_host)
        self.candidates.refresh()
        while n > self.host.free_pages:
            short = n - self.host.free_pages
            if self.shed_host(n):
                continue
            if await self.evict_host(short) >= short:
                continue
            if self.host.free_pages >= min(n, self._unleased("host")) or not await waits.next():
                break
        k = min(n, self.host.free_pages) if partial else n
        return self.host.allocator.allocate(k)

    def _unleased(self, tier: str) -> int:
        """Pages of ``tier`` that callers do not hold: the most that waiting for jobs could free."""
        pool = self.device if tier == "device" else self.host
        return pool.capacity_pages - self.tree.leased_pages[tier]

    # -- device ---------------------------------------------------------------------------------

    _device_leaf = staticmethod(device_leaf)

    async def settle(self) -> None:
        """Return once no device eviction round is in flight: its spills have their host copies
        (what a shutdown's drain must see before it writes the host to storage)."""
        async with self._device_lock:
            pass

    async def evict_device(self, n_pages: int) -> int:
        """Free at least ``n_pages`` device pages if the residency rule allows; return how many."""
        async with self._device_lock:
            self.candidates.refresh()
            freed = 0
            while freed < n_pages:
                dropped, spilled = await self._evict_round(
                    n_pages - freed, DEVICE_LEAF, self.residency.leave_device,
                    lambda node, _: self._drop_device(node), self._spill,
                )
                freed += dropped
                if not dropped and not spilled:
                    break
            return freed

    async def _victims(
        self, kind: int, wanted: Callable[[TreeNode], bool], taken: list[TreeNode]
    ) -> AsyncIterator[TreeNode]:
        """Candidates of ``kind`` in policy order, each once; every node popped is added to ``taken``
        (the caller notes them back to the tree when its round ends)."""
        seen: set[int] = set()
        while (node := self.candidates.pop(kind)) is not None:
            taken.append(node)
            if not len(taken) % _YIELD_EVERY:
                await anyio.lowlevel.checkpoint()  # a bulk eviction lets other calls in
            if node.id in seen or not wanted(node):
                continue
            seen.add(node.id)
            yield node

    async def _evict_round(
        self,
        n_pages: int,
        kind: int,
        leave: Callable[[TreeNode], Verdict],
        drop: Callable[[TreeNode, Verdict], int],
        copy_down: Callable[[list[TreeNode], int], Awaitable[int]],
    ) -> tuple[int, bool]:
        """Drop victims of ``kind`` in policy order as ``leave`` (the residency rule) allows; those it
        says must first be copied to the tier below go there in one batch (``copy_down``, told how
        many pages are still wanted), then are dropped if they still may be. Returns the pages freed
        and whether anything was copied."""
        candidates = self.candidates
        wanted = candidates.wanted(kind)
        candidates.refresh()
        freed = 0
        pending = 0
        to_copy: list[TreeNode] = []
        taken: list[TreeNode] = []
        try:
            async with aclosing(self._victims(kind, wanted, taken)) as victims:
                async for node in victims:
                    verdict = leave(node)
                    if verdict is Verdict.COPY:
                        to_copy.append(node)
                        pending += node.num_pages
                    elif verdict in (Verdict.FREE, Verdict.LOST):
                        freed += drop(node, verdict)
                        candidates.refresh()  # its parent may be a candidate now
                    if freed + pending >= n_pages:
                        break
            copied = await copy_down(to_copy, n_pages - freed) if to_copy else 0
            for node in to_copy:
                if wanted(node) and (verdict := leave(node)) in (Verdict.FREE, Verdict.LOST):
                    freed += drop(node, verdict)
        finally:
            for node in taken:  # waiting, not copied, or dropped: the tree's report re-queues what still qualifies
                self.tree.note(node)
        return freed, copied > 0

    def _drop_device(self, node: TreeNode) -> int:
        pages = node.device
        assert pages is not None
        node.device = None
        self.device.allocator.free(pages)
        self.counters.evicted_pages["device"] += len(pages)
        if node.host is None:
            if self.residency.owed_below(node):
                self.counters.lost_pages["device"] += len(pages)  # its write failed: this was its last copy
            self.tree.remove(node)
        return len(pages)

    async def _spill(self, nodes: list[TreeNode], wanted: int) -> int:
        """Copy the device pages of ``nodes`` to new host pages in one batch; pages copied.

        A victim the host could hold is asked whole (room is made for it, as for any allocation);
        a larger one asks only for the ``wanted`` pages the eviction still needs (or the host's free
        room, if more). A victim that gets fewer pages than it has is split so that its last
        pages, as many as it got, are spilled (``_tail_run``); the rest stays a device leaf for the
        next round. Nodes that find no host room (the host is full of pinned pages) stay.
        """
        placed: list[tuple[TreeNode, list[bytes], list[int], Pin]] = []
        done = False
        try:
            # Inside the try: reserving host room for a later victim may wait (a write to storage
            # first) and be cancelled; the victims placed by then must be released.
            for node in nodes:
                # A node the host can hold goes whole, as room is made for it; a larger one by runs
                # sized to what the eviction still needs (not the whole host each round).
                if node.num_pages <= self._unleased("host"):
                    ask = node.num_pages
                else:
                    ask = min(node.num_pages, max(wanted, self.host.free_pages))
                host_pages = await self.alloc_host(ask, partial=True) if ask > 0 else []
                if not host_pages or self.residency.leave_device(node) is not Verdict.COPY or not self._device_leaf(node):
                    self.host.allocator.free(host_pages)
                    continue
                # Another call may have split the victim while we waited (it keeps the deepest pages).
                node = self._tail_run(node, len(host_pages))
                self.host.allocator.free(host_pages[node.num_pages :])
                host_pages = host_pages[: node.num_pages]
                wanted -= len(host_pages)
                node.backing_up = True
                placed.append((node, list(node.keys), host_pages, Pin(node, job=True)))
            if not placed:
                return 0
            # Read the pages from the nodes that hold the victims' keys now: another call may have
            # split a victim while a later one waited for host room (its prefix moved to a new parent).
            src = [
                p
                for node, keys, _, _ in placed
                for covered, _, _ in reversed(self.tree.covering(node, keys))
                for p in covered.device or ()
            ]
            dst = [p for _, _, pages, _ in placed for p in pages]
            with self.frees_host.running():  # it waits for nothing but the copy now
                await anyio.to_thread.run_sync(self.engine.device_to_host, src, dst, limiter=self.limiter)
            done = True
        finally:
            for node, keys, host_pages, pin in placed:
                for covered, start, end in self.tree.covering(node, keys):
                    covered.backing_up = False
                    if done:
                        covered.host = host_pages[start:end]
                if not done:
                    self.host.allocator.free(host_pages)
                pin.release()
        self.counters.spills += len(dst)
        self.counters.bytes_moved["device_to_host"] += len(dst) * self.device.geometry.page_bytes
        if self.on_host_copy is not None:
            for node, keys, _, _ in placed:
                for covered, _, _ in self.tree.covering(node, keys):
                    await self.on_host_copy(covered)
        return len(dst)

    def _tail_run(self, node: TreeNode, pages: int) -> TreeNode:
        """The last ``pages`` pages of ``node`` as a node of their own (``node`` itself, split).

        The split keeps the original node object as the suffix, so it stays a device leaf with
        the same children; its prefix becomes its parent, a device leaf once the run has left.
        """
        if pages < node.num_pages:
            self.tree.split(node, node.num_pages - pages)
        return node

    # -- host -----------------------------------------------------------------------------------

    _host_leaf = staticmethod(host_leaf)
    _host_mirror = staticmethod(host_mirror)

    def shed_host(self, n_pages: int) -> bool:
        """Shed sliding layers (policy order) until ``n_pages`` whole pages fit in the host's budget
        or nothing is left to shed; whether anything was shed."""
        keep = self.shed_keep
        if keep is None:
            return False
        candidates = self.candidates
        candidates.refresh()
        taken: list[TreeNode] = []
        shed = 0
        try:
            while self.host.free_pages < n_pages and (node := candidates.pop(HOST_SHED)) is not None:
                taken.append(node)
                if not self.residency.may_shed(node):
                    continue
                pages = node.host
                assert pages is not None
                end = node.num_pages - keep
                self.host.shed(list(pages[node.thin : end]))
                shed += end - node.thin
                node.thin = end
        finally:
            for node in taken:
                self.tree.note(node)
        self.counters.sliding_shed_pages += shed
        return shed > 0

    async def evict_host(self, n_pages: int) -> int:
        """Drop at least ``n_pages`` host pages if the residency rule allows; return how many."""
        async with self._host_lock:
            self.candidates.refresh()
            freed = 0
            for kind in (HOST_LEAF, HOST_MIRROR):
                while freed < n_pages:
                    dropped, written = await self._evict_round(
                        n_pages - freed, kind, self.residency.leave_host,
                        lambda node, verdict: self._drop_host(node, lost=verdict is Verdict.LOST),
                        self._write_to_storage,
                    )
                    freed += dropped
                    if not dropped and not written:
                        break
            return freed

    def _drop_host(self, node: TreeNode, *, lost: bool) -> int:
        pages = node.host
        assert pages is not None
        node.host = None
        self.host.allocator.free(pages)
        self.counters.evicted_pages["host"] += len(pages)
        if node.device is None:
            if lost:
                self.counters.lost_pages["host"] += len(pages)
            self.tree.remove(node)
        return len(pages)

    async def _write_to_storage(self, nodes: list[TreeNode], wanted: int) -> int:
        """Write the victims to storage before they are dropped (write-back, or a missed write-through).

        Whole nodes: a write needs no room anywhere, so there is nothing to cut into runs.
        """
        writer = self.storage_writer
        assert writer is not None
        jobs = [writer.prepare(nd) for nd in nodes]
        results: list[bool] | list[None] = [None] * len(jobs)  # None: cancelled, still owed
        try:
            results = await writer.write(jobs)
        finally:
            for job, ok in zip(jobs, results, strict=True):
                writer.finish(job, ok)
        written = sum(len(j.keys) for j, ok in zip(jobs, results, strict=True) if ok)
        self.counters.spills_to_storage += written
        return written
