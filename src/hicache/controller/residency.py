"""The one rule for residency: which copies down a page is owed, and when it may leave a memory tier.

This module is the only one that asks the write policy. **Copies owed now** (``host_copy_due``,
``storage_copy_due``), asked by the controller once per store, commit or retrieve hit
(``CacheController.owe_copies``) and when a node gets host pages (``host_copy_made``): a device-only
node is owed its host copy right after it was stored (``backup_on_insert``) or after a hit
(``backup_on_hit``); a node with host pages is owed its storage write when ``store_on_host`` says so.

**Leaving a tier.** A page leaves a tier only when every tier the write policy promised it to holds
it, or its write there failed and is counted as lost. The promise is the write policy's
(``promises_lower``); this module turns it and a node's state into a verdict, and the eviction loop
(``evictor.py``) is the only place that asks, for both tiers:

* ``FREE``: it may leave now (the tier below holds it, or nothing was promised);
* ``COPY``: promised below and not there yet, no copy in flight: copy it down first (a spill);
* ``WAIT``: its copy down is queued or in flight: pick another victim, or wait for the copy;
* ``LOST``: its write to storage failed: it may leave, and ``lost_pages`` counts it when this was
  its last copy in memory (a host copy of a page still on the device is not lost yet).

**Shedding** (a compact host, ``tiers/shed.py``): the sliding layers of a host-only page outside
every window may leave the host before any page does, when the page itself could leave it
(``may_shed``: its host pages are ``FREE`` to go), or when every tier it is owed to is layer-split:
those keep windows only, never these layers, so nothing promised is lost. A page owed to a tier
that stores whole pages keeps them until it is written there.

The device boundary leads to the host tier, the host boundary to every storage tier; the lowest
tier there is (the host without storage tiers, the device without a host tier) may always drop.
Storage tiers come and go at runtime (``attach_storage`` / ``detach_storage``), so whether there is
storage below the host is read from the live list of tiers each time, never fixed at construction.

A rank of a parallel engine that does not write shared storage (``writes_storage=False``: an MLA
rank but the first, a replica of a KV head; ``Namespace.writes_storage``) reads it but is owed
nothing there: the writing rank stores those bytes. For it the host is the bottom of what the policy
promises, so its host pages may always leave, none counts as lost, and it never writes.
"""

from __future__ import annotations

from collections.abc import Sized
from enum import Enum

from ..policies.base import WritePolicy
from ..radix_tree import TreeNode

__all__ = ["Residency", "Verdict"]


class Verdict(Enum):
    FREE = "free"
    COPY = "copy"
    WAIT = "wait"
    LOST = "lost"


class Residency:
    def __init__(
        self, write_policy: WritePolicy, *, has_host: bool = True, has_storage: bool = False,
        storage: Sized | None = None, writes_storage: bool = True,
    ) -> None:
        self.write_policy = write_policy
        self.has_host = has_host  # no host tier (capacity 0): the device is the bottom
        self._storage = storage  # the controller's live list of storage tiers (attach/detach change it)
        self._fixed_storage = has_storage
        self.writes_storage = writes_storage  # False: another rank writes these pages to shared storage

    @property
    def has_storage(self) -> bool:
        """Is there a storage tier below the host right now that takes writes? (A read-only tier,
        ``backend.writable`` false, is promised nothing.)"""
        if self._storage is None:
            return self._fixed_storage
        return any(getattr(getattr(t, "backend", None), "writable", True) for t in self._storage)

    @property
    def owes_storage(self) -> bool:
        """Is there storage below the host that this cache writes (and so owes pages to) right now?"""
        return self.writes_storage and self.has_storage

    def host_copy_due(self, node: TreeNode, *, hit: bool = False) -> bool:
        """Is device-only ``node`` owed its host copy now: right after it was stored, or (``hit``)
        after a retrieve hit it (``node.hit_count`` already counts the hit)?"""
        if node.device is None or node.host is not None:
            return False
        policy = self.write_policy
        return policy.backup_on_hit(node) if hit else policy.backup_on_insert(node)

    def storage_copy_due(self, node: TreeNode) -> bool:
        """Are ``node``'s host pages owed their storage write now (storage below that this cache writes)?"""
        return node.host is not None and self.owes_storage and self.write_policy.store_on_host(node)

    def promised(self, node: TreeNode) -> bool:
        """Does the write policy promise ``node``'s pages to the tier below the one they are in?"""
        return self.write_policy.promises_lower(node)

    def leave_device(self, node: TreeNode) -> Verdict:
        """May ``node``'s device pages be dropped? (The caller checked it is unpinned and not loading.)"""
        if node.host is not None or not self.has_host:
            return Verdict.FREE
        if node.backing_up:
            return Verdict.WAIT
        # A node with children keeps a copy in memory: dropping it would orphan them.
        if node.children:
            return Verdict.COPY
        if (self.has_storage and node.stored) or not self.promised(node):
            return Verdict.FREE  # storage holds it already, or nothing was promised
        # Its storage write failed already: a host copy could only be dropped later as lost.
        return Verdict.LOST if self.owes_storage and node.store_failed else Verdict.COPY

    def leave_host(self, node: TreeNode) -> Verdict:
        """May ``node``'s host pages be dropped? (The caller checked it is unpinned and not loading.)"""
        if node.storing:
            # A write reads these pages, even one whose tiers were all detached meanwhile (it ends at once).
            return Verdict.WAIT
        if not self.owes_storage or node.stored:
            return Verdict.FREE
        if not self.promised(node):
            return Verdict.FREE
        if node.store_failed:
            return Verdict.LOST
        return Verdict.COPY

    def may_shed(self, node: TreeNode) -> bool:
        """May ``node``'s host pages outside its end's window drop their sliding layers? (The caller
        checked it is host-only, unpinned and no copy is in flight.)"""
        verdict = self.leave_host(node)
        if verdict is Verdict.FREE:
            return True
        return verdict is Verdict.COPY and self._storage is not None and all(
            getattr(t, "window_pages", 0) for t in self._storage if getattr(getattr(t, "backend", None), "writable", True)
        )

    def owed_below(self, node: TreeNode) -> bool:
        """Pages the policy promised to storage that storage does not hold (what shutdown drains)."""
        return self.owes_storage and not node.stored and self.promised(node)
