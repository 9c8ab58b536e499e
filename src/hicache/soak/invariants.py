"""Consistency checks of a live cache: the index against the allocators, leases against pins.

Used by the soak between phases and by the test suite after every scenario. Each check returns the
problems it found (an empty list: consistent), so the soak can count them and tests can assert.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cache import HiCache
    from ..radix_tree import TreeNode

__all__ = ["consistency_problems"]


def consistency_problems(cache: HiCache, pins: Iterable[TreeNode] = (), *, quiescent: bool = True) -> list[str]:
    """Every invariant the controller promises that does not hold right now.

    ``pins``: the deepest node of each live lease. With ``quiescent`` (no background job running,
    e.g. after ``await cache.wait_idle()``), the pages allocated in each tier must be exactly the
    pages the index references: nothing leaked, nothing referenced twice, no pin left behind.
    """
    ctl = cache.controller
    tree = ctl.tree
    pins = list(pins)
    problems: list[str] = []
    expected_locks: Counter[int] = Counter()
    for node in pins:
        cur: TreeNode | None = node
        while cur is not None and cur is not tree.root:
            expected_locks[cur.id] += 1
            cur = cur.parent
    if quiescent and tree.root.lock_ref != 1 + len(pins):
        problems.append(f"root lock_ref {tree.root.lock_ref}, expected {1 + len(pins)} ({len(pins)} leases)")
    used: dict[str, Counter[int]] = {"device": Counter(), "host": Counter()}
    for node in tree.nodes():
        parent = node.parent
        if parent is None or parent.children.get(node.tokens[: tree.page_bytes]) is not node:
            problems.append(f"{node!r}: not linked from its parent under its first page")
            continue
        if len(node.tokens) != node.num_pages * tree.page_bytes or node.num_pages == 0:
            problems.append(f"{node!r}: tokens and keys disagree")
        if node.device is None and node.host is None:
            problems.append(f"{node!r} holds no copy")
        if node.device is not None:
            if len(node.device) != node.num_pages:
                problems.append(f"{node!r}: {len(node.device)} device pages for {node.num_pages} keys")
            if parent is not tree.root and parent.device is None:
                problems.append(f"device residency not prefix-closed at {node!r}")
            used["device"].update(node.device)
        if node.host is not None:
            if len(node.host) != node.num_pages:
                problems.append(f"{node!r}: {len(node.host)} host pages for {node.num_pages} keys")
            used["host"].update(node.host)
            # A page whose sliding layers' memory is gone reads zeros there: it must be thin.
            wrong = [p for p in node.host[node.thin :] if ctl.host.allocator.is_shed(p)]
            if wrong:
                problems.append(f"{node!r}: host pages {wrong[:8]} are shed but not thin (thin={node.thin})")
        if quiescent:
            if node.loading is not None or node.backing_up or node.storing:
                problems.append(f"{node!r} still in flight")
            if node.lock_ref != expected_locks[node.id]:
                problems.append(f"{node!r}: lock_ref {node.lock_ref} != {expected_locks[node.id]} (a leaked pin)")
            if node.lease_ref != node.lock_ref:
                problems.append(f"{node!r}: lease_ref {node.lease_ref} != lock_ref {node.lock_ref} with no job running")
    for name, tier in (("device", ctl.device), ("host", ctl.host)):
        twice = [p for p, n in used[name].items() if n > 1]
        if twice:
            problems.append(f"{name} pages referenced twice: {twice[:8]}")
        for page in used[name]:
            if not tier.allocator.is_allocated(page):
                problems.append(f"{name} page {page} referenced but free")
                break
        if quiescent and tier.used_pages != len(used[name]):
            problems.append(f"{name}: {tier.used_pages} pages allocated but {len(used[name])} referenced (leak)")
    shed_pages = ctl.host.allocator.shed_pages
    if quiescent and shed_pages > len(used["host"]):
        problems.append(f"host: {shed_pages} pages counted shed, {len(used['host'])} referenced")
    return problems
