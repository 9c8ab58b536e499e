"""Built-in write policies (device -> host)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import WritePolicy

if TYPE_CHECKING:
    from ..radix_tree import TreeNode

__all__ = ["WriteThrough", "WriteThroughSelective", "WriteBack"]


class WriteThrough(WritePolicy):
    """Back up every stored page at once: device eviction is then free (the host copy exists)."""

    name = "write_through"

    def backup_on_insert(self, node: TreeNode) -> bool:
        return True

    def backup_on_hit(self, node: TreeNode) -> bool:
        return False


class WriteThroughSelective(WritePolicy):
    """Back up only pages hit at least ``threshold`` times: saves host bandwidth on one-off prompts."""

    name = "write_through_selective"

    def __init__(self, threshold: int = 2) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold

    def backup_on_insert(self, node: TreeNode) -> bool:
        return False

    def backup_on_hit(self, node: TreeNode) -> bool:
        return node.hit_count >= self.threshold


class WriteBack(WritePolicy):
    """Copy to host only when the device evicts: the least host traffic, a spill on eviction."""

    name = "write_back"
    spill_on_evict = True

    def backup_on_insert(self, node: TreeNode) -> bool:
        return False

    def backup_on_hit(self, node: TreeNode) -> bool:
        return False
