"""Policy interfaces: which pages to evict first, and when to copy pages down a tier.

Policies are pure decisions over tree nodes; the controller does the moving. An eviction policy only
gives a sort key (smallest evicted first), so every policy shares one correct eviction loop that
already honours leases, in-flight transfers and prefix-closedness.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..radix_tree import TreeNode

__all__ = ["EvictionPolicy", "WritePolicy"]


class EvictionPolicy(ABC):
    """Orders eviction candidates: the node with the smallest key goes first.

    A node's key may grow while it is cached (a hit, a touch) but never shrink: the evictor keeps
    candidates in heaps and re-checks a key only when its entry reaches the top
    (``controller/candidates.py``). Every built-in policy keeps to this.
    """

    name: str = "eviction"

    @abstractmethod
    def key(self, node: TreeNode) -> Any:
        """Sort key of a candidate node."""


class WritePolicy(ABC):
    """When device pages are copied to the host tier."""

    name: str = "write"
    #: Copy a node's pages to host when it is evicted from the device without a host copy.
    spill_on_evict: bool = False

    @abstractmethod
    def backup_on_insert(self, node: TreeNode) -> bool:
        """Back up a node right after it was stored?"""

    @abstractmethod
    def backup_on_hit(self, node: TreeNode) -> bool:
        """Back up a node after a hit (``node.hit_count`` already counts it)?"""

    def promises_lower(self, node: TreeNode) -> bool:
        """Must ``node``'s pages reach the next tier down before they may leave this one?

        Write-through promises every page (its copy is made at once, so eviction is free);
        selective write-through promises the hot pages; write-back promises every page, copied at
        eviction. The eviction loop enforces the promise (``controller/residency.py``).
        """
        return self.spill_on_evict or self.backup_on_insert(node) or self.backup_on_hit(node)

    def store_on_host(self, node: TreeNode) -> bool:
        """Write a node's host pages to storage as soon as it has them (the host -> storage boundary)?

        The same rule as device -> host: at once under write-through, once hot under selective
        write-through, never under write-back (which writes to storage on host eviction instead).
        """
        return self.backup_on_insert(node) or self.backup_on_hit(node)
