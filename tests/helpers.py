"""Test helpers: an exact consistency check of the index against the allocators."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterable

import torch

from hicache import HiCache
from hicache.radix_tree import TreeNode
from hicache.soak.invariants import consistency_problems


def pinned_nodes(views: Iterable[object]) -> list[TreeNode]:
    """The deepest node pinned by each live lease (RetrieveView) in ``views``."""
    out = []
    for view in views:
        pin = getattr(view, "_pin", None)
        if pin is not None and not getattr(view, "_released", True):
            out.append(pin.node)
    return out


def assert_consistent(cache: HiCache, pins: Iterable[TreeNode] = (), *, quiescent: bool = True) -> None:
    """Every invariant the controller promises holds (``hicache.soak.invariants``).

    ``pins``: the deepest node of each live lease. With ``quiescent`` (no background job running,
    e.g. after ``await cache.wait_idle()``), nothing leaked, nothing referenced twice.
    """
    problems = consistency_problems(cache, pins, quiescent=quiescent)
    assert not problems, "; ".join(problems[:10])


async def push_to_storage(cache: HiCache) -> None:
    """Let pending writes finish, then evict everything from device and host: only storage is left."""
    await cache.wait_idle()
    evictor = cache.controller.evictor
    await evictor.evict_device(cache.controller.device.num_pages)
    await evictor.evict_host(cache.controller.host.num_pages)
    assert not list(cache.controller.tree.nodes()), "something is still cached in memory"


def snapshot(cache: HiCache) -> tuple:
    """What a rejected call must leave unchanged: the index with every page, the allocators and the counters."""
    ctl = cache.controller
    tree = tuple(
        (node.tokens, tuple(node.device or ()), tuple(node.host or ()), node.lock_ref, node.hit_count)
        for node in ctl.tree.nodes()
    )
    c = ctl.counters
    counters = (c.lookups, c.retrieves, c.stores, c.stored_pages, c.dropped_pages, dict(c.evicted_pages),
                dict(c.bytes_moved))
    return tree, ctl.device.used_pages, ctl.host.used_pages, counters


def resident_share(t: torch.Tensor) -> float:
    """The share of ``t``'s whole memory pages that are resident (``mincore``, Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    start = (t.data_ptr() + page - 1) // page * page
    length = (t.data_ptr() + t.numel() * t.element_size() - start) // page * page
    vec = (ctypes.c_ubyte * (length // page))()
    assert libc.mincore(start, length, vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / len(vec)
