"""Host -> storage writes, shared by the storage worker (backups) and host eviction (write-back spills).

A job marks its node ``storing`` while the write is in flight, so host eviction keeps the pages it
reads; the device copy may still be evicted meanwhile. A write that fails marks the node
``store_failed``: it is not tried again, and its pages may then leave the host, counted as lost. Each tier is written from host memory (tiers
are written side by side, a lower tier is not fed from the one above it), after asking it which
pages it already has: keys are chained, so ``exists`` says how many leading pages to skip. A tier
whose backend is not ``writable`` (it only reads) is skipped, and promised nothing.

Tiers may be attached or detached while a write runs: a write goes to the tiers attached when it
starts (a snapshot). A tier detached meanwhile is skipped, and its failures do not count: a page
is never marked failed (and later counted lost) for a tier that no longer exists. A write all of
whose tiers were detached reports nothing (``None``): its pages stay owed to whatever storage there
is when they would leave memory. ``wait_writes_to(tier)`` lets a detach wait for the writes that
still include the tier.
"""

from __future__ import annotations

import anyio

from ..radix_tree import HiRadixTree, TreeNode
from ..stats import Counters
from ..tiers.storage.tier import StorageTier
from .jobs import StorageJob

__all__ = ["StorageWriter"]


class StorageWriter:
    def __init__(
        self, tree: HiRadixTree, tiers: list[StorageTier], counters: Counters, page_bytes: int, *,
        slack_pages: int = 0, checkpoints: bool = False,
    ) -> None:
        self.tree = tree
        #: The pages before a hit's end whose sliding layers a layer-split tier keeps: the window,
        #: and ``slack_pages`` more for ends a little before it (``policies.window_slack_tokens``).
        #: A recurrent model's whole pages are its checkpoints, already few: each one is written.
        self.checkpoints = checkpoints
        self.tail_pages = tree.window_pages + slack_pages if tree.window_pages and not checkpoints else 0
        self.tiers = tiers
        self.counters = counters
        self.page_bytes = page_bytes
        self._running: dict[int, tuple[StorageTier, ...]] = {}  # write id -> its tiers
        self._ids = 0
        self._changed = anyio.Event()

    def wanted(self, node: TreeNode) -> bool:
        return (
            any(t.backend.writable for t in self.tiers) and node.host is not None and not node.stored
            and not node.writing and not node.store_failed
        )

    def prepare(self, node: TreeNode) -> StorageJob:
        """Claim ``node``'s host pages for a write; ``finish`` must follow (in a ``finally``)."""
        assert self.wanted(node)
        node.writing = True
        node.storing += 1
        assert node.host is not None
        job = StorageJob(
            node, list(node.keys), list(node.host), sliding_tail=self._sliding_tail(node), thin=node.thin
        )
        # A window longer than the node: the end needs the sliding layers of its ancestors' last
        # pages too (a layer-split tier may have written them thin). So does the parent's end when
        # it is a branch point (this node branched off there, after the parent's own window was
        # written for an end further down). Their host pages are read as this node's are:
        # ``storing`` keeps them. A thin page ends the walk: it has no sliding layers to write.
        missing = job.sliding_tail - node.num_pages
        parent = node.parent
        if self.tail_pages and parent is not None and parent.parent is not None and len(parent.children) > 1:
            missing = max(missing, self.tail_pages)
        cur = parent
        while missing > 0 and cur is not None and cur.parent is not None and cur.host is not None:
            take = min(missing, cur.num_pages - cur.thin)
            if take > 0:
                keys = cur.keys
                job.window.append((cur, keys, keys[-take:], list(cur.host)[-take:]))
                cur.storing += 1
            if take < min(missing, cur.num_pages):
                break
            missing -= take
            cur = cur.parent
        return job

    def _sliding_tail(self, node: TreeNode) -> int:
        """The last pages of ``node`` (and its ancestors) in the window and slack (``tail_pages``)
        of the nearest possible hit end at or below it: a leaf (a prompt ended there) or a branch
        point. A node with one child (a store placed on two tiers, a prefill stored in chunks) is
        no such end itself. A recurrent model's node: all of it (its checkpoints)."""
        if self.checkpoints:
            return node.num_pages
        tail = self.tail_pages
        below, cur = 0, node
        while tail and len(cur.children) == 1:
            cur = next(iter(cur.children.values()))
            below += cur.num_pages
            if below >= tail:
                return 0
        return max(0, tail - below)

    def finish(self, job: StorageJob, stored: bool | None) -> None:
        """End the job: ``True`` written, ``False`` the write failed, ``None`` it was cancelled
        before it could tell (the pages stay owed, to be written again)."""
        for covered, _, _ in self.tree.covering(job.node, job.keys):
            covered.writing = False
            covered.storing -= 1
            if stored:
                covered.stored = True
            elif stored is False:
                covered.store_failed = True
            self.tree.note(covered)  # its host pages may be shed now (a compact host)
        for node, keys, _, _ in job.window:
            for covered, _, _ in self.tree.covering(node, keys):
                covered.storing -= 1
                self.tree.note(covered)

    async def write(self, jobs: list[StorageJob]) -> list[bool | None]:
        """Write every job to every tier attached now; per job, whether all of those still attached
        hold all of its pages (``None`` when every one of them was detached meanwhile)."""
        tiers = tuple(self.tiers)
        ok: list[bool | None] = [True] * len(jobs)
        self._ids += 1
        me = self._ids
        self._running[me] = tiers
        try:
            for tier in tiers:
                if tier.detached or not tier.backend.writable:
                    continue  # a read-only tier (a nixl-peer consumer) is written nothing
                keys: list[bytes] = []
                pages: list[int] = []
                owner: list[int] = []
                sliding: list[bool] = []  # a layer-split tier: the pages whose sliding layers it keeps
                refused: set[int] = set()  # jobs a whole-page tier cannot be written (thin pages)
                windows = 0
                for j, job in enumerate(jobs):
                    if tier.window_pages:
                        have, window_from, more = await self._sliding_plan(tier, job)
                        windows += more
                    else:
                        have, window_from = await tier.exists(job.keys), len(job.keys)
                        if job.thin > have:
                            # Thin pages would be stored whole with zeros for KV: not written
                            # (the job reports short, its pages count as lost if they leave).
                            refused.add(j)
                            continue
                    tier.skipped_pages += have
                    keys += job.keys[have:]
                    pages += job.host_pages[have:]
                    owner += [j] * (len(job.keys) - have)
                    sliding += [i >= window_from for i in range(have, len(job.keys))]
                if tier.window_pages:
                    # The ancestors' windows (``prepare``), also when every page of the jobs is stored.
                    windows += await self._write_windows(tier, jobs)
                    self.counters.bytes_moved["host_to_storage"] += tier.payload_bytes(0, windows)  # type: ignore[attr-defined]
                for j in refused:
                    ok[j] = False
                if not keys:
                    continue
                if tier.window_pages:
                    written = await tier.store(keys, pages, sliding=sliding)
                    moved = tier.payload_bytes(written, sum(sliding[:written]))  # type: ignore[attr-defined]
                else:
                    written = await tier.store(keys, pages)
                    moved = written * self.page_bytes
                self.counters.storage_backups += written
                self.counters.bytes_moved["host_to_storage"] += moved
                if tier.detached:
                    continue  # detached while we wrote: its shortfall is nobody's loss
                for j in set(owner[written:]):
                    ok[j] = False
        finally:
            del self._running[me]
            self._changed.set()
            self._changed = anyio.Event()
        if all(tier.detached for tier in tiers):
            return [None] * len(jobs)
        return ok

    async def _sliding_plan(self, tier: StorageTier, job: StorageJob) -> tuple[int, int, int]:
        """For a layer-split tier: how many of the job's pages it holds the full parts of from the
        start (not written again), the first page from which the pages written keep their sliding
        parts, and how many sliding parts were written now for pages it already held.

        A hit may end where the job's node ends (its ``sliding_tail``) and where the tier's stored
        prefix of the job's keys stops: a prompt stored before went on with other tokens there, so
        a later one may branch off at that point too, and its window may be missing (the tier
        kept the window of the earlier prompt's end only). Thin pages keep no sliding part."""
        n = len(job.keys)
        full = await tier.full_parts(job.keys)  # type: ignore[attr-defined]
        flag_from = max(n - job.sliding_tail, job.thin)
        lo = flag_from
        if 0 < full < n:
            lo = min(lo, max(full - self.tail_pages, job.thin))
        written = 0
        if lo < full and not tier.detached:
            written = await tier.store_sliding(job.keys[lo:full], job.host_pages[lo:full])  # type: ignore[attr-defined]
        return full, flag_from, written

    @staticmethod
    async def _write_windows(tier: StorageTier, jobs: list[StorageJob]) -> int:
        """The sliding layers of the ancestors' window pages each job's end needs (best effort:
        an end whose window is not whole in storage is a shorter hit, never a wrong one); the
        sliding parts written."""
        written = 0
        for job in jobs:
            keys = job.window_keys
            if keys and not tier.detached:
                written += await tier.store_sliding(keys, job.window_pages)  # type: ignore[attr-defined]
        return written

    def writing_to(self, tier: StorageTier) -> int:
        """How many writes in flight include ``tier``."""
        return sum(tier in tiers for tiers in self._running.values())

    async def wait_writes_to(self, tier: StorageTier) -> None:
        """Return once no write in flight includes ``tier`` (new writes never do once it is detached
        from the list)."""
        while self.writing_to(tier):
            await self._changed.wait()
