"""Where new pages go: the one place a ``store`` or a ``commit`` is placed in the tiers and the index.

A store's pages go to the device tier, and to the host tier when the device cannot make room
(``alloc_device`` / ``alloc_host`` with ``partial=True``: they evict and wait as any allocation
does). Device residency is prefix-closed, so pages after a host-only prefix go to the host, and a
prefix that leaves the device while the store copies (``place_unplaced``) puts the new pages on the
host below it instead: a store never drops pages while the host has room. Pages already cached
(before, or by another call meanwhile) are freed and counted as cached; pages after a gap (the
tokens before them are no longer cached) cannot be attached and are dropped.

This module decides and publishes; which copies down the new nodes are owed is the residency
rule's (``residency.py``), asked once per store by the controller (``CacheController.owe_copies``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..io.transfer import TransferEngine
from ..keys import TokenBytes
from ..radix_tree import HiRadixTree, Pin, TreeNode
from ..stats import Counters
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from .evictor import Evictor
from .jobs import JobTracker

__all__ = ["Insertion", "Placed", "Placement"]


@dataclass
class Insertion:
    """What ``insert_pages`` did with the pages it was given."""

    nodes: list[TreeNode] = field(default_factory=list)  # new nodes, in order
    duplicates: int = 0  # pages cached by another call meanwhile (freed)
    dropped: int = 0  # pages that could not be attached (freed)
    parent: TreeNode | None = None  # with unplaced pages: the host-only node they go under
    at: int = 0  # the page index of the first unplaced page
    unplaced_device: list[int] = field(default_factory=list)
    unplaced_host: list[int] = field(default_factory=list)
    whole: frozenset[int] | None = None  # a recurrent model's store: the pages holding checkpoints

    @property
    def stored(self) -> int:
        return sum(nd.num_pages for nd in self.nodes)


@dataclass(frozen=True)
class Placed:
    """Where a store's or a commit's pages went, in pages: what the facade reports."""

    nodes: list[TreeNode]  # the new nodes, prefix first: what the residency rule is asked about
    stored: int  # newly cached
    cached: int  # cached already (before, or by another call meanwhile)
    dropped: int  # not placed (no room, or after a gap)


class Placement:
    """Places new pages; built by the controller when it opens (the evictor and trackers live then).

    ``frees_device`` / ``frees_host``: the jobs an allocation short of room may wait for (a store
    between its allocation and its insertion is one); ``kick_eviction``: wake the watermark worker.
    """

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        device: DevicePool,
        host: HostPool,
        engine: TransferEngine,
        evictor: Evictor,
        counters: Counters,
        limiter: anyio.CapacityLimiter,
        frees_device: JobTracker,
        frees_host: JobTracker,
        kick_eviction: Callable[[], None],
        sliding_layers: tuple[int, ...] = (),
        checkpoints: bool = False,
    ) -> None:
        self.tree = tree
        self.sliding_layers = sliding_layers
        #: A recurrent model: a page is whole only where its store gave it a checkpoint.
        self.checkpoints = checkpoints
        self.device = device
        self.host = host
        self.engine = engine
        self.evictor = evictor
        self.counters = counters
        self.limiter = limiter
        self.frees_device = frees_device
        self.frees_host = frees_host
        self.kick_eviction = kick_eviction
        self._page_bytes = device.geometry.page_bytes

    # -- the two ways pages arrive ----------------------------------------------------------------

    async def store(
        self, tb: TokenBytes, kv: Any, *, start: int, priority: int, whole: frozenset[int] | None = None
    ) -> Placed:
        """Place the full pages of ``tb`` not cached yet, their KV copied from ``kv`` (the KV of
        ``tb[start:]``, validated by the caller; ``start`` a multiple of the page size). A recurrent
        model's store names the pages ``kv`` holds a checkpoint for (``whole``); the others are
        placed thin (``TreeNode.thin``), so no hit ends on them."""
        if self.checkpoints and whole is None:
            whole = frozenset()
        counters = self.counters
        counters.stores += 1
        ps = self.tree.page_size
        full = len(tb) // self.tree.page_bytes
        # A hybrid's store may fill thin pages up to where its prompt leaves the index: a node
        # ends there, so filled pages never sit behind thin ones of the same node.
        match = self.tree.match(tb, split=bool(self.sliding_layers and self.tree.window_pages))
        if self.checkpoints:
            self._fill_checkpoints(match.path, kv, start // ps, whole or frozenset())
        else:
            self._fill_thin(match.path, kv, start // ps)
        if match.pages >= full:
            self.tree.touch(match.path)
            return Placed([], 0, full, 0)
        if match.pages * ps < start:
            # tokens[match:start] are neither cached nor given: later pages have nothing to attach to.
            dropped = full - start // ps
            counters.dropped_pages += dropped
            return Placed([], 0, match.pages, dropped)
        first, need = match.pages, full - match.pages
        pin = Pin(match.path[-1]) if match.path else None
        try:
            # Device residency is prefix-closed: pages after a host-only prefix go to host.
            parent_on_device = not match.path or match.path[-1].device is not None
            dev = await self.evictor.alloc_device(need, partial=True) if parent_on_device else []
            try:
                host = await self.evictor.alloc_host(need - len(dev), partial=True)
            except BaseException:
                self.device.allocator.free(dev)
                raise
            with self.publishing():
                try:
                    await anyio.to_thread.run_sync(
                        self._write_user_pages, kv, first - start // ps, dev, host, limiter=self.limiter
                    )
                except BaseException:
                    self.device.allocator.free(dev)
                    self.host.allocator.free(host)
                    raise
                inserted = self.insert_pages(tb, first, dev, host, priority, whole=whole)
            # The prefix may have left the device meanwhile: then our device pages move to the host.
            placed = await self.place_unplaced(tb, inserted, priority)
        finally:
            if pin is not None:
                pin.release()
        stored = placed.stored
        dropped = need - stored - placed.duplicates
        counters.stored_pages += stored
        counters.dropped_pages += dropped
        counters.bytes_moved["user_to_device"] += len(dev) * self._page_bytes
        counters.bytes_moved["user_to_host"] += len(host) * self._page_bytes
        self.kick_eviction()
        return Placed(placed.nodes, stored, first + placed.duplicates, dropped)

    async def commit(
        self, tb: TokenBytes, first_page: int, pages: list[int], priority: int, *, on_host: bool = False,
        whole: frozenset[int] | None = None,
    ) -> Placed:
        """Publish pages an engine wrote in place (a reservation's, now the cache's) as pages
        ``first_page..`` of ``tb``: device pages, or (``on_host``) host pages, which need no
        placing (host residency has no prefix rule). A recurrent model's pages are placed thin
        but for those in ``whole``, which carry the checkpoints the engine wrote."""
        if self.checkpoints and whole is None:
            whole = frozenset()
        inserted = self.insert_pages(
            tb, first_page, [] if on_host else pages, pages if on_host else [], priority, whole=whole
        )
        placed = await self.place_unplaced(tb, inserted, priority)
        self.counters.stored_pages += placed.stored
        self.counters.dropped_pages += placed.dropped
        self.kick_eviction()
        return Placed(placed.nodes, placed.stored, placed.duplicates, placed.dropped)

    def _thin_in_window(
        self, path: list[TreeNode], first: int, whole: frozenset[int] | None = None
    ) -> list[tuple[TreeNode, int, int]]:
        """The nodes of ``path`` whose thin pages lie in the window before its end, from page
        ``first`` on: ``(node, its first page, the first page to fill)``; each to fill up to the
        end of its thin run, so its thin pages stay its leading ones. A node with a copy between
        tiers in flight is left thin (that copy could carry the zeros back over). A recurrent
        model's page is filled only from a checkpoint (in ``whole``)."""
        window = self.tree.window_pages
        if not (window and self.sliding_layers and path):
            return []
        end = sum(node.num_pages for node in path)
        low = max(end - window, first)
        out = []
        at = 0
        for node in path:
            begin, at = at, at + node.num_pages
            lo = max(begin, low)
            if lo < begin + node.thin and node.loading is None and not node.backing_up:
                if self.checkpoints and not all(p in (whole or ()) for p in range(lo, begin + node.thin)):
                    continue
                out.append((node, begin, lo))
        return out

    def _fill_thin(self, path: list[TreeNode], kv: Any, start_page: int) -> None:
        """Give the thin pages in the window before the end of ``path`` (the cached part of a
        store's prompt) their sliding layers from ``kv`` (the KV of pages ``start_page..``), so
        that end, where the prompt's new pages branch off, is a hit again and storage can be
        written its window. Synchronous: nothing is freed or copied under it."""
        for node, begin, lo in self._thin_in_window(path, start_page):
            thin_end = begin + node.thin
            for pool, pages in ((self.device, node.device), (self.host, node.host)):
                if pages is not None:
                    held = list(pages[lo - begin : thin_end - begin])
                    if pool is self.host:
                        self.host.restore(held)  # whole again: they cost their full size
                    self.engine.user_layers_to_pool(kv, lo - start_page, pool, held, self.sliding_layers)
            node.thin = lo - begin
            self.tree.note(node)

    def _fill_checkpoints(self, path: list[TreeNode], kv: Any, start_page: int, whole: frozenset[int]) -> None:
        """A recurrent model's store gives the thin pages of its cached prefix the checkpoints it
        computed there (``whole``; ``kv`` holds pages ``start_page..``): a prompt that once
        recomputed a stored prefix leaves the states it passed, so the next one branching off
        inside it continues from there. A node is cut after each page filled, so its thin pages
        stay its leading ones. Synchronous, as ``_fill_thin``."""
        at = 0
        for node in list(path):
            begin, at = at, at + node.num_pages
            targets = sorted((p for p in whole if max(begin, start_page) <= p < begin + node.thin), reverse=True)
            if not targets or node.loading is not None or node.backing_up:
                continue
            cur = node
            for page in targets:
                cut = page - begin + 1
                if cut < cur.num_pages:
                    cur = self.tree.split(cur, cut)  # ``page`` is the prefix part's last
                for pool, pages in ((self.device, cur.device), (self.host, cur.host)):
                    if pages is not None:
                        held = [pages[page - begin]]
                        if pool is self.host:
                            self.host.restore(held)
                        self.engine.user_layers_to_pool(kv, page - start_page, pool, held, self.sliding_layers)
                cur.thin = page - begin
                self.tree.note(cur)

    def _fill_thin_from(
        self, path: list[TreeNode], first: int, slots: list[tuple[bool, int]], whole: frozenset[int] | None
    ) -> None:
        """As ``_fill_thin``, from pages an engine wrote in place that turn out cached already
        (``slots``: pages ``first..`` of the prompt, about to be freed as duplicates)."""
        for node, begin, lo in self._thin_in_window(path, first, whole):
            thin_end = begin + node.thin
            if thin_end > first + len(slots):
                continue  # the thin run goes on past what was written: it could not end thin
            source = slots[lo - first : thin_end - first]
            for pool, pages in ((self.device, node.device), (self.host, node.host)):
                if pages is None:
                    continue
                held = list(pages[lo - begin : thin_end - begin])
                if pool is self.host:
                    self.host.restore(held)
                for on_device, tier in ((True, self.device), (False, self.host)):
                    pairs = [(p, d) for (dev, p), d in zip(source, held) if dev == on_device]
                    self.engine.pool_layers_to_pool(
                        tier, [p for p, _ in pairs], pool, [d for _, d in pairs], self.sliding_layers
                    )
            node.thin = lo - begin
            self.tree.note(node)

    def _write_user_pages(self, kv: Any, first: int, dev: list[int], host: list[int]) -> None:
        self.engine.user_to_pool(kv, first, self.device, dev)
        self.engine.user_to_pool(kv, first + len(dev), self.host, host)

    @contextmanager
    def publishing(self) -> Iterator[None]:
        """A store between its allocation and its insertion: its pages will soon be evictable, so
        an allocation short of room may wait for it (it never waits for room itself in here)."""
        self.frees_device.add()
        self.frees_host.add()
        try:
            yield
        finally:
            self.frees_device.done()
            self.frees_host.done()

    # -- the index ------------------------------------------------------------------------------

    def insert_pages(
        self, tb: TokenBytes, first: int, dev: list[int], host: list[int], priority: int = 0, *,
        whole: frozenset[int] | None = None,
    ) -> Insertion:
        """Publish pages holding pages ``first..`` of ``tb`` (device ones first) in the index.

        Synchronous, so nothing changes under it. Pages that another call cached meanwhile are
        freed (``duplicates``); pages that cannot be attached after a gap are freed (``dropped``).
        Device pages whose parent is host-only are not attached (device residency is
        prefix-closed): they and the host pages after them come back in ``unplaced`` with the
        node they go under, for ``place_unplaced`` to move to the host. ``whole``: a recurrent
        model's checkpoint pages; a node is cut after each, the others are thin (its leading pages).
        """
        tree = self.tree
        pb = tree.page_bytes
        slots = [(True, p) for p in dev] + [(False, p) for p in host]  # (on device?, page)
        usable = max(0, min(len(slots), len(tb) // pb - first))
        self._free_slots(slots[usable:])
        match = tree.match(tb[: (first + usable) * pb], split=True)
        parent = match.path[-1] if match.path else tree.root
        if match.pages < first:
            # The pages before ours left the cache: ours cannot be attached without a gap.
            self._free_slots(slots[:usable])
            return Insertion(dropped=len(slots))
        duplicates = match.pages - first
        if duplicates:
            self._fill_thin_from(match.path, first, slots[:duplicates], whole)
        self._free_slots(slots[:duplicates])
        rest = slots[duplicates:usable]
        pos = first + duplicates
        keep_dev = [p for on_dev, p in rest if on_dev]
        keep_host = [p for on_dev, p in rest if not on_dev]
        if keep_dev and parent is not tree.root and parent.device is None:
            return Insertion(duplicates=duplicates, dropped=len(slots) - usable, parent=parent, at=pos,
                             unplaced_device=keep_dev, unplaced_host=keep_host, whole=whole)
        nodes: list[TreeNode] = []
        for pages, attr in ((keep_dev, "device"), (keep_host, "host")):
            for run in _checkpoint_runs(pages, pos, whole):
                node = tree.extend(parent, tb[pos * pb : (pos + len(run)) * pb])
                setattr(node, attr, run)
                node.priority = priority
                if whole is not None:
                    node.thin = len(run) - (pos + len(run) - 1 in whole)
                nodes.append(node)
                parent, pos = node, pos + len(run)
        return Insertion(nodes=nodes, duplicates=duplicates, dropped=len(slots) - usable)

    def _free_slots(self, slots: list[tuple[bool, int]]) -> None:
        self.device.allocator.free([p for on_dev, p in slots if on_dev])
        self.host.allocator.free([p for on_dev, p in slots if not on_dev])

    async def place_unplaced(self, tb: TokenBytes, result: Insertion, priority: int = 0) -> Insertion:
        """Move device pages that ``insert_pages`` could not attach (under a host-only node) to the host.

        Stores never drop pages while the host has room: a prefix that left the device while a
        store was running puts the new pages on the host, below it, instead.
        """
        if not result.unplaced_device:
            return result
        assert result.parent is not None
        moving, after = result.unplaced_device, result.unplaced_host
        pin = Pin(result.parent)  # the node they go under must stay while we copy
        host_pages: list[int] = []
        try:
            try:
                host_pages = await self.evictor.alloc_host(len(moving), partial=True)
                if host_pages:
                    await anyio.to_thread.run_sync(
                        self.engine.device_to_host, moving[: len(host_pages)], host_pages, limiter=self.limiter
                    )
            except BaseException:
                self.host.allocator.free(host_pages)
                self._free_slots([(True, p) for p in moving] + [(False, p) for p in after])
                raise
            self.device.allocator.free(moving)
            self.counters.bytes_moved["device_to_host"] += len(host_pages) * self._page_bytes
            if len(host_pages) < len(moving):
                # The host is full of leased pages: what follows the gap cannot be attached.
                self.host.allocator.free(after)
                after = []
            second = self.insert_pages(tb, result.at, [], host_pages + after, priority, whole=result.whole)
        finally:
            pin.release()
        gap = len(moving) - len(host_pages) + len(result.unplaced_host) - len(after)
        return Insertion(
            nodes=second.nodes, duplicates=result.duplicates + second.duplicates,
            dropped=result.dropped + second.dropped + gap,
        )


def _checkpoint_runs(pages: list[int], first: int, whole: frozenset[int] | None) -> list[list[int]]:
    """``pages`` (pages ``first..`` of a prompt) cut after each checkpoint page in ``whole``, so
    each run's only whole page is its last: thin pages stay a node's leading ones."""
    if whole is None or not pages:
        return [pages] if pages else []
    runs: list[list[int]] = [[]]
    for i, page in enumerate(pages):
        runs[-1].append(page)
        if first + i in whole and i + 1 < len(pages):
            runs.append([])
    return runs
