"""Eviction candidates, kept up to date as nodes change, so that choosing a victim costs O(log n).

Three kinds of candidate, one heap each, ordered by the eviction policy's key (then node id):

* ``DEVICE_LEAF``: on the device, no device-resident child, unpinned, not loading: the device takes
  these (device residency stays prefix-closed);
* ``HOST_LEAF``: host-only, childless, unpinned, not loading: the host's first choice (the node
  leaves the tree);
* ``HOST_MIRROR``: on both tiers, unpinned, not loading: the host's second choice.

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
outnumber the live nodes, by a rebuild.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from ..policies.base import EvictionPolicy
from ..radix_tree import HiRadixTree, TreeNode

__all__ = ["DEVICE_LEAF", "HOST_LEAF", "HOST_MIRROR", "Candidates", "device_leaf", "host_leaf", "host_mirror"]

DEVICE_LEAF = 0
HOST_LEAF = 1
HOST_MIRROR = 2


def device_leaf(node: TreeNode) -> bool:
    return node.device is not None and node.lock_ref == 0 and node.loading is None and not node.device_children


def host_leaf(node: TreeNode) -> bool:
    return (
        node.host is not None and node.device is None and not node.children
        and node.lock_ref == 0 and node.loading is None
    )


def host_mirror(node: TreeNode) -> bool:
    """A host copy of a node that is still on the device (the host's second choice)."""
    return node.host is not None and node.device is not None and node.lock_ref == 0 and node.loading is None


_WANTED: tuple[Callable[[TreeNode], bool], ...] = (device_leaf, host_leaf, host_mirror)
_QUEUED = (2, 4, 8)  # TreeNode.marks bits: queued in heap DEVICE_LEAF / HOST_LEAF / HOST_MIRROR
_Entry = tuple[Any, int, TreeNode]


class Candidates:
    """The candidate heaps of one tree under one eviction policy."""

    def __init__(self, tree: HiRadixTree, policy: EvictionPolicy) -> None:
        self.tree = tree
        self.policy = policy
        self._heaps: list[list[_Entry]] = [[], [], []]

    def wanted(self, kind: int) -> Callable[[TreeNode], bool]:
        return _WANTED[kind]

    def refresh(self) -> None:
        """Queue the nodes the tree reported since the last refresh that are candidates now."""
        if not self.tree.changed:
            return
        key = self.policy.key
        heaps = self._heaps
        for node in self.tree.take_changed():
            if node.parent is None:
                continue  # removed from the tree (or the root)
            marks = node.marks
            for kind in (DEVICE_LEAF, HOST_LEAF, HOST_MIRROR):
                bit = _QUEUED[kind]
                if not marks & bit and _WANTED[kind](node):
                    marks |= bit
                    heapq.heappush(heaps[kind], (key(node), node.id, node))
            node.marks = marks
        self._compact()

    def pop(self, kind: int) -> TreeNode | None:
        """The candidate of ``kind`` with the smallest current key, taken out of its heap; None if none.

        The caller hands it back with ``HiRadixTree.note`` once done with it (it may still be one).
        """
        heap = self._heaps[kind]
        bit = _QUEUED[kind]
        wanted = _WANTED[kind]
        key = self.policy.key
        while heap:
            old, _, node = heap[0]
            if node.parent is None or not wanted(node):
                heapq.heappop(heap)
                node.marks &= ~bit
                continue
            now = key(node)
            if now != old:  # touched since it was queued: it belongs further back
                heapq.heapreplace(heap, (now, node.id, node))
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
                live = [entry for entry in heap if entry[2].parent is not None]
                heapq.heapify(live)
                self._heaps[kind] = live
