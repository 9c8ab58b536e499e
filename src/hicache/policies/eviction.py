"""Built-in eviction orders. Each is one sort key; ties fall back to recency."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import EvictionPolicy

if TYPE_CHECKING:
    from ..radix_tree import TreeNode

__all__ = ["LRUPolicy", "LFUPolicy", "FIFOPolicy", "PriorityPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def key(self, node: TreeNode) -> tuple[float, int]:
        return (node.last_access, node.id)


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
