"""Making a cached prefix durable in one storage tier: what a prefill server owes a decode server.

The write policy promises storage a page *eventually*; a prefill/decode hand-off needs to know
*when*: the decode side is told to expect a prompt's pages, and the prefill side may report them
sent (and free the engine's blocks) only once the tier they cross through holds them. ``persist``
gets there with the cache's own write path, no second one:

1. the prefix's nodes are pinned (nothing of it leaves memory meanwhile);
2. pages with host copies that nobody has written yet are queued to the storage worker (the write
   policy may not owe them: ``write_back``, or a policy that writes only hot pages), and the
   writes already queued or in flight for the prefix are waited for;
3. the tier itself is asked how many leading pages it holds (``exists``): storage is shared and
   lossy, so that answer, not the index's ``stored`` hint, is what is reported. Pages the index
   believes stored that the tier no longer has (evicted by its own LRU, flushed by an operator)
   are owed again and written once more.

A page whose write failed (``store_failed``) stops the answer before it; with ``retry_s`` its
write is tried again (the mark forgiven, backing off 0.05 s to 1 s) while that time lasts, so a
tier that refuses a write for a moment (a store's put lease revoked under load, a full disk freed)
still gets the prefix within the caller's bound. A rank
that does not write shared storage (``Namespace.writes_storage``: a replica of a KV head) waits
for the rank that does, asking the tier until it holds the prefix. The caller bounds the whole
call (a cancel scope); nothing is left queued on its behalf but ordinary owed writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

from ..keys import TokenBytes, chain_keys
from ..radix_tree import Pin, TreeNode

if TYPE_CHECKING:
    from ..tiers.storage.tier import StorageTier
    from .controller import CacheController

__all__ = ["persist"]

_POLL_S = (0.002, 0.005, 0.01, 0.02, 0.05)  # how often a non-writing rank asks the tier again
_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # the pause before a failed write is tried again


async def persist(ctl: CacheController, tb: TokenBytes, tier: StorageTier, *, retry_s: float = 0.0) -> int:
    """Leading pages of ``tb``'s full pages that ``tier`` holds once the cache has written what it
    can; failed writes are tried again for ``retry_s`` seconds."""
    keys = chain_keys(ctl.tree.seed, tb, ctl.tree.page_size)
    if not keys:
        return 0
    match = ctl.tree.match(tb, split=True)
    pin = Pin(match.path[-1]) if match.path else None
    try:
        in_memory = min(match.pages, len(keys))
        if not ctl.residency.owes_storage:
            return await _wait_for_writer(tier, keys, in_memory)
        await _write_owed(ctl, tb)
        have = await _held(tier, keys)
        if have < in_memory:
            # The index believed these pages stored (a write or a read said so) but the tier has
            # lost them: they are owed again, and written from host memory once more.
            _owe_again(ctl, tb, have)
            await _write_owed(ctl, tb)
            have = await _held(tier, keys)
        until = anyio.current_time() + retry_s
        i = 0
        while have < in_memory:
            pause = _RETRY_S[min(i, len(_RETRY_S) - 1)]
            failed = _failed_past(ctl, tb, have)
            if not failed or anyio.current_time() + pause > until:
                break
            await anyio.sleep(pause)
            i += 1
            for node in failed:  # forgiven only now, with the write queued next (not before a cancelled sleep)
                if node.host is not None:
                    node.store_failed = False
            await _write_owed(ctl, tb)
            have = await _held(tier, keys)
        return have
    finally:
        if pin is not None:
            pin.release()


async def _held(tier: StorageTier, keys: list[bytes]) -> int:
    return min(await tier.exists(keys), len(keys))


async def _write_owed(ctl: CacheController, tb: TokenBytes) -> None:
    """Copy the prefix's device-only pages to the host and queue its unwritten host pages for
    storage, until no copy or write of the prefix is pending. A host copy is asked once: one the
    host had no room for is not asked again (the answer then stops before that page)."""
    asked: set[int] = set()
    while True:
        path = ctl.tree.match(tb).path
        for node in path:
            if node.host is None:
                if id(node) not in asked:
                    asked.add(id(node))
                    await ctl.submit_backup(node)  # its storage write follows the host copy, or the next round
            elif ctl.storage_writer.wanted(node):
                await ctl.submit_storage_backup(node)
        path = ctl.tree.match(tb).path
        if not any(node.storing or node.backing_up for node in path):
            return
        await ctl.jobs.wait_done()  # a copy or a write ended: look again


def _owe_again(ctl: CacheController, tb: TokenBytes, have: int) -> None:
    pos = 0
    for node in ctl.tree.match(tb).path:
        if pos + node.num_pages > have and node.stored and not node.writing:
            node.stored = False
        pos += node.num_pages


def _failed_past(ctl: CacheController, tb: TokenBytes, have: int) -> list[TreeNode]:
    """The prefix's nodes past the tier's first ``have`` pages whose write failed, with host pages to write again."""
    failed, pos = [], 0
    for node in ctl.tree.match(tb).path:
        if pos + node.num_pages > have and node.store_failed and node.host is not None:
            failed.append(node)
        pos += node.num_pages
    return failed


async def _wait_for_writer(tier: StorageTier, keys: list[bytes], pages: int) -> int:
    """This rank writes nothing (another rank does): ask the tier until those pages are there."""
    have = await _held(tier, keys)
    i = 0
    while have < pages:
        await anyio.sleep(_POLL_S[min(i, len(_POLL_S) - 1)])
        i += 1
        have = await _held(tier, keys)
    return have
