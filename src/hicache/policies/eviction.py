"""Built-in eviction orders. Each is one sort key; ties fall back to recency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import EvictionPolicy

if TYPE_CHECKING:
    from ..radix_tree import TreeNode

__all__ = ["LRUPolicy", "LFUPolicy", "FIFOPolicy", "PriorityPolicy", "ScanResistantLRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def key(self, node: TreeNode) -> tuple[float, int]:
        return (node.last_access, node.id)


class ScanResistantLRUPolicy(EvictionPolicy):
    """Least recently used first, but pages read back from storage go before all others until
    they are hit again while cached.

    A loop over more prefixes than a tier holds (questions visiting long documents in turn) makes
    LRU evict exactly the prefix asked for next: each one read back displaces the one read least
    recently. Here a read-back enters at the cold end: the next read-back displaces it, not the
    prefixes the tier already serves, so the tier keeps serving its share of the loop. The access
    that brought it counts as its arrival; a hit after that is reuse, and it is ordered by recency
    like any other page. Pages computed here (stored) are never on probation; a prefix that grows
    keeps its read-back part cached as long as its new pages (eviction takes leaves).
    """

    name = "scan_resistant_lru"

    def key(self, node: TreeNode) -> tuple[bool, float, int]:
        reused = node.readback_hits < 0 or node.hit_count > node.readback_hits + 1
        return (reused, node.last_access, node.id)


class LFUPolicy(EvictionPolicy):
    """Fewest hits first, then least recently used."""

    name = "lfu"

    def key(self, node: TreeNode) -> tuple[int, float, int]:
        return (node.hit_count, node.last_access, node.id)


class FIFOPolicy(EvictionPolicy):
    """Oldest inserted first, whatever its use."""

    name = "fifo"

    def key(self, node: TreeNode) -> tuple[float, int]:
        return (node.created, node.id)


class PriorityPolicy(EvictionPolicy):
    """Lowest ``priority`` (given at ``store``) first, then least recently used."""

    name = "priority"

    def key(self, node: TreeNode) -> tuple[int, float, int]:
        return (node.priority, node.last_access, node.id)
