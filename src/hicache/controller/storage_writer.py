"""Host -> storage writes, shared by the storage worker (backups) and host eviction (write-back spills).

A job marks its node ``storing`` while the write is in flight, so host eviction keeps the pages it
reads; the device copy may still be evicted meanwhile. A write that fails marks the node
``store_failed``: it is not tried again, and its pages may then leave the host, counted as lost. Each tier is written from host memory (tiers
are written side by side, a lower tier is not fed from the one above it), after asking it which
pages it already has: keys are chained, so ``exists`` says how many leading pages to skip.
"""

from __future__ import annotations

from ..radix_tree import HiRadixTree, TreeNode
from ..stats import Counters
from ..tiers.storage.tier import StorageTier
from .jobs import StorageJob

__all__ = ["StorageWriter"]


class StorageWriter:
    def __init__(self, tree: HiRadixTree, tiers: list[StorageTier], counters: Counters, page_bytes: int) -> None:
        self.tree = tree
        self.tiers = tiers
        self.counters = counters
        self.page_bytes = page_bytes

    def wanted(self, node: TreeNode) -> bool:
        return (
            bool(self.tiers) and node.host is not None and not node.stored and not node.storing
            and not node.store_failed
        )

    def prepare(self, node: TreeNode) -> StorageJob:
        """Claim ``node``'s host pages for a write; ``finish`` must follow (in a ``finally``)."""
        assert self.wanted(node)
        node.storing = True
        assert node.host is not None
        return StorageJob(node, list(node.keys), list(node.host))

    def finish(self, job: StorageJob, stored: bool | None) -> None:
        """End the job: ``True`` written, ``False`` the write failed, ``None`` it was cancelled
        before it could tell (the pages stay owed, to be written again)."""
        for covered, _, _ in self.tree.covering(job.node, job.keys):
            covered.storing = False
            if stored:
                covered.stored = True
            elif stored is False:
                covered.store_failed = True

    async def write(self, jobs: list[StorageJob]) -> list[bool]:
        """Write every job to every tier; per job, whether all tiers now hold all of its pages."""
        ok = [True] * len(jobs)
        for tier in self.tiers:
            keys: list[bytes] = []
            pages: list[int] = []
            owner: list[int] = []
            for j, job in enumerate(jobs):
                have = await tier.exists(job.keys)
                tier.skipped_pages += have
                keys += job.keys[have:]
                pages += job.host_pages[have:]
                owner += [j] * (len(job.keys) - have)
            if not keys:
                continue
            written = await tier.store(keys, pages)
            for j in set(owner[written:]):
                ok[j] = False
            self.counters.storage_backups += written
            self.counters.bytes_moved["host_to_storage"] += written * self.page_bytes
        return ok
