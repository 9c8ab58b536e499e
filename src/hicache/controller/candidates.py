"""Eviction candidates, kept up to date as nodes change, so that choosing a victim costs O(log n).

Three kinds of candidate, one heap each, ordered by the eviction policy's key (then node id):

* ``DEVICE_LEAF``: on the device, no device-resident child, unpinned, not loading: the device takes
  these (device residency stays prefix-closed);
* ``HOST_LEAF``: host-only, childless, unpinned, not loading: the host's first choice (the node
  leaves the tree);
* ``HOST_MIRROR``: on both tiers, unpinned, not loading: the host's second choice.
* ``HOST_SHED`` (a compact host only): host-only, unpinned, not loading, with pages before its last
  ``keep`` whose sliding layers are still held: what the host sheds before it evicts anything.

The tree reports every node whose candidacy may have changed (``HiRadixTree.changed``: residency,
pins released, loads finished, children removed; ``radix_tree.py``), and ``refresh()`` pushes
those that are candidates and not queued yet. A heap entry is checked when it reaches the top
(``pop``): a node that is no longer a candidate is dropped (it is pushed again when the tree reports
it again), and a node whose key changed since its entry was pushed (a hit or touch makes it later)
is pushed again with its current key. So victims come out in exactly the order of their current
keys, as a full sort would give, provided a node's key never decreases while it is cached: true of
every built-in policy (recency, hit count, insertion time and the priority given at ``store`` only
grow or stay), and the contract of ``EvictionPolicy.key``.

A node is in each heap at most once (``TreeNode.marks`` bits), so a heap holds at most one entry per
live node plus entries of removed nodes, which are dropped when they surface or, once they
outnumber the live nodes, by a rebuild. An entry is ``(*key, node)`` for the built-in policies
(their keys are tuples of one length that end with the node id, so ties never reach the node):
one tuple per entry instead of two. Any other policy's entries are ``(key, node.id, node)``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from ..policies.base import EvictionPolicy
from ..policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy, PriorityPolicy, ScanResistantLRUPolicy
from ..radix_tree import HiRadixTree, TreeNode

__all__ = [
    "DEVICE_LEAF", "HOST_LEAF", "HOST_MIRROR", "HOST_SHED", "Candidates", "device_leaf", "host_leaf", "host_mirror",
    "host_sheddable",
]

DEVICE_LEAF = 0
HOST_LEAF = 1
HOST_MIRROR = 2
HOST_SHED = 3


def device_leaf(node: TreeNode) -> bool:
    return node.on_device and node.lock_ref == 0 and node.loading is None and not node.device_children


def host_leaf(node: TreeNode) -> bool:
    return node.on_host and not node.on_device and not node.children and node.lock_ref == 0 and node.loading is None


def host_mirror(node: TreeNode) -> bool:
    """A host copy of a node that is still on the device (the host's second choice).

    Pinned or not: a lease reads the device copy, and the page stays in memory there; only a
    load-back reads the host copy (``loading``), and a storage write keeps it (``storing``).
    """
    return node.on_host and node.on_device and node.loading is None


def host_sheddable(node: TreeNode, keep: int) -> bool:
    """Host-only, unpinned, no copy in flight, and holding the sliding layers of pages before its
    last ``keep`` (the window and slack its end needs)."""
    return (
        node.on_host and not node.on_device and node.lock_ref == 0 and node.loading is None
        and not node.storing and not node.backing_up and node.thin < node.num_pages - keep
    )


_QUEUED = (2, 4, 8, 16)  # TreeNode.marks bits: queued in heap DEVICE_LEAF / HOST_LEAF / HOST_MIRROR / HOST_SHED
# keys: fixed-length tuples ending in the id
_FLAT_KEYS = (LRUPolicy, LFUPolicy, FIFOPolicy, PriorityPolicy, ScanResistantLRUPolicy)
_Entry = tuple[Any, ...]


class Candidates:
    """The candidate heaps of one tree under one eviction policy."""

    def __init__(self, tree: HiRadixTree, policy: EvictionPolicy, *, shed_keep: int | None = None) -> None:
        """``shed_keep``: pages at each node's end a compact host keeps whole (None: no shedding)."""
        self.tree = tree
        self.policy = policy
        self._wanted: list[Callable[[TreeNode], bool]] = [device_leaf, host_leaf, host_mirror]
        if shed_keep is not None:
            keep = shed_keep
            self._wanted.append(lambda node: host_sheddable(node, keep))
        self._kinds = range(len(self._wanted))
        self._heaps: list[list[_Entry]] = [[] for _ in self._wanted]
        self._flat = type(policy) in _FLAT_KEYS

    def _entry(self, node: TreeNode) -> _Entry:
        key = self.policy.key(node)
        return (*key, node) if self._flat else (key, node.id, node)

    def _queued_key(self, entry: _Entry) -> Any:
        return entry[:-1] if self._flat else entry[0]

    def wanted(self, kind: int) -> Callable[[TreeNode], bool]:
        return self._wanted[kind]

    def refresh(self) -> None:
        """Queue the nodes the tree reported since the last refresh that are candidates now."""
        if not self.tree.changed:
            return
        entry = self._entry
        heaps = self._heaps
        for node in self.tree.take_changed():
            if node.parent is None:
                continue  # removed from the tree (or the root)
            marks = node.marks
            for kind in self._kinds:
                bit = _QUEUED[kind]
                if not marks & bit and self._wanted[kind](node):
                    marks |= bit
                    heapq.heappush(heaps[kind], entry(node))
            node.marks = marks
        self._compact()

    def pop(self, kind: int) -> TreeNode | None:
        """The candidate of ``kind`` with the smallest current key, taken out of its heap; None if none.

        The caller hands it back with ``HiRadixTree.note`` once done with it (it may still be one).
        """
        heap = self._heaps[kind]
        bit = _QUEUED[kind]
        wanted = self._wanted[kind]
        key = self.policy.key
        while heap:
            top = heap[0]
            node = top[-1]
            if node.parent is None or not wanted(node):
                heapq.heappop(heap)
                node.marks &= ~bit
                continue
            if key(node) != self._queued_key(top):  # touched since it was queued: it belongs further back
                heapq.heapreplace(heap, self._entry(node))
                continue
            heapq.heappop(heap)
            node.marks &= ~bit
            return node
        return None

    def __len__(self) -> int:
        return sum(len(h) for h in self._heaps)

    def _compact(self) -> None:
        """Drop entries of removed nodes once they could outnumber the live ones (amortized O(1))."""
        limit = 2 * self.tree.size + 64
        for kind, heap in enumerate(self._heaps):
            if len(heap) > limit:
                live = [entry for entry in heap if entry[-1].parent is not None]
                heapq.heapify(live)
                self._heaps[kind] = live
