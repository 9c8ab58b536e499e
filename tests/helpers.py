"""Test helpers: an exact consistency check of the index against the allocators."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from hicache import HiCache
from hicache.radix_tree import TreeNode


def pinned_nodes(views: Iterable[object]) -> list[TreeNode]:
    """The deepest node pinned by each live lease (RetrieveView) in ``views``."""
    out = []
    for view in views:
        pin = getattr(view, "_pin", None)
        if pin is not None and not getattr(view, "_released", True):
            out.append(pin.node)
    return out


def assert_consistent(cache: HiCache, pins: Iterable[TreeNode] = (), *, quiescent: bool = True) -> None:
    """Check every invariant the controller promises.

    ``pins``: the deepest node of each live lease. With ``quiescent`` (no background job running,
    e.g. after ``await cache.wait_idle()``), the pages allocated in each tier must be exactly the pages
    the index references: nothing leaked, nothing referenced twice.
    """
    ctl = cache.controller
    tree = ctl.tree
    pins = list(pins)
    expected_locks: Counter[int] = Counter()
    for node in pins:
        cur: TreeNode | None = node
        while cur is not None and cur is not tree.root:
            expected_locks[cur.id] += 1
            cur = cur.parent
    if quiescent:
        assert tree.root.lock_ref == 1 + len(pins), f"root lock_ref {tree.root.lock_ref}, {len(pins)} pins"
    used = {"device": Counter(), "host": Counter()}
    for node in tree.nodes():
        parent = node.parent
        assert parent is not None
        assert parent.children.get(node.tokens[: tree.page_bytes]) is node, "child key does not match its tokens"
        assert len(node.tokens) == node.num_pages * tree.page_bytes
        assert node.num_pages > 0
        assert node.device is not None or node.host is not None, f"{node!r} holds no copy"
        if node.device is not None:
            assert len(node.device) == node.num_pages
            assert parent is tree.root or parent.device is not None, f"device residency not prefix-closed at {node!r}"
            used["device"].update(node.device)
        if node.host is not None:
            assert len(node.host) == node.num_pages
            used["host"].update(node.host)
        if quiescent:
            assert node.loading is None and not node.backing_up and not node.storing, f"{node!r} still in flight"
            assert node.lock_ref == expected_locks[node.id], f"{node!r}: lock_ref {node.lock_ref} != {expected_locks[node.id]}"
    for name, tier in (("device", ctl.device), ("host", ctl.host)):
        twice = [p for p, n in used[name].items() if n > 1]
        assert not twice, f"{name} pages referenced twice: {twice[:8]}"
        for page in used[name]:
            assert tier.allocator.is_allocated(page), f"{name} page {page} referenced but free"
        if quiescent:
            assert tier.used_pages == len(used[name]), (
                f"{name}: {tier.used_pages} pages allocated but {len(used[name])} referenced (leak)"
            )


async def push_to_storage(cache: HiCache) -> None:
    """Let pending writes finish, then evict everything from device and host: only storage is left."""
    await cache.wait_idle()
    evictor = cache.controller.evictor
    await evictor.evict_device(cache.controller.device.num_pages)
    await evictor.evict_host(cache.controller.host.num_pages)
    assert not list(cache.controller.tree.nodes()), "something is still cached in memory"
