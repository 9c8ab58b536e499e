"""Bookkeeping that does not grow with the pool, checked through the cache itself.

``benchmarks/scale.py`` measures the cost; these tests check the behaviour that makes it possible:
a large eviction shares the event loop instead of holding it, the lease counters that bound an
allocation's wait stay exact through real stores, retrieves and evictions, and the victims come
out in the policy's order on a pool large enough that a full scan would show.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from hicache import HiCache
from hicache.keys import as_token_bytes

from .conftest import make_config, make_kv, make_tokens

PAGE = 4  # SMALL's page size


def distinct(i: int, pages: int = 1) -> list[int]:
    return list(range(i * pages * PAGE, (i + 1) * pages * PAGE))


def brute_leased(cache: HiCache) -> dict[str, int]:
    out = {"device": 0, "host": 0}
    for node in cache.controller.tree.nodes():
        if node.lease_ref:
            out["device"] += len(node.device or ())
            if node.device is None:  # a leased node's host mirror may be evicted
                out["host"] += len(node.host or ())
    return out


async def test_a_bulk_eviction_lets_other_tasks_run() -> None:
    config = make_config(4096, 0)
    async with HiCache.from_config(config) as cache:
        ctl = cache.controller
        pages = ctl.device.allocator.allocate(4096)
        for i in range(4096):  # 4096 one-page nodes, published directly (no copies needed here)
            ctl.placement.insert_pages(as_token_bytes(distinct(i)), 0, pages[i : i + 1], [])
        ticks: list[int] = []
        done = anyio.Event()

        async def ticker() -> None:
            while not done.is_set():
                ticks.append(ctl.device.free_pages)
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await anyio.lowlevel.checkpoint()
            freed = await ctl.evictor.evict_device(4096)
            done.set()
        assert freed == 4096 and ctl.device.free_pages == 4096
        during = [free for free in ticks if 0 < free < 4096]
        assert len(during) >= 4096 // 256 - 2, f"the ticker ran {len(during)} times during the eviction"


@pytest.mark.parametrize("write", ["write_through", "write_back"])
async def test_lease_counters_stay_exact_under_real_traffic(write: str) -> None:
    config = make_config(24, 48, policies={"write": write})
    # 13 prompts of 3-4 pages do not fit in 24 device pages: evictions, and loads under a lease.
    prompts = [make_tokens((3 + i % 2) * PAGE, seed=i % 13) for i in range(40)]
    async with HiCache.from_config(config) as cache:
        tree = cache.controller.tree
        held = []
        for i, tokens in enumerate(prompts):
            await cache.store(tokens, make_kv(config, len(tokens), seed=i % 13))
            lease = cache.retrieve(prompts[(i * 5) % len(prompts)])
            held.append((lease, await lease.__aenter__()))
            assert tree.leased_pages == brute_leased(cache)
            if len(held) > 3:
                lease, _ = held.pop(0)
                await lease.__aexit__(None, None, None)
            assert tree.leased_pages == brute_leased(cache)
        for lease, _ in held:
            await lease.__aexit__(None, None, None)
        await cache.wait_idle()
        assert tree.leased_pages == brute_leased(cache) == {"device": 0, "host": 0}
        assert cache.stats().loads > 0 and cache.stats().tiers["device"].evicted_pages > 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "fifo", "priority", "scan_resistant_lru"])
async def test_victims_leave_in_policy_order_on_a_large_pool(policy: str) -> None:
    """Evicting one page at a time from 2,000 touched nodes gives the full sort's order."""
    config = make_config(2000, 0, policies={"eviction": policy})
    async with HiCache.from_config(config) as cache:
        ctl = cache.controller
        pages = ctl.device.allocator.allocate(2000)
        owner = {}
        for i in range(2000):
            (node,) = ctl.placement.insert_pages(as_token_bytes(distinct(i)), 0, pages[i : i + 1], [], priority=i % 3).nodes
            owner[pages[i]] = node
            if i % 5 == 0:  # as a prefetch publishes a read-back (only scan_resistant_lru reads it)
                node.readback_hits = node.hit_count
        await ctl.evictor.evict_device(0)  # queues them all (as a store's allocation would)
        for i in range(0, 2000, 7):  # hits move some nodes back in LRU and LFU order
            await cache.lookup(distinct(i))
            for _ in range(1 + i % 2):  # a read-back is reused from its second hit
                async with cache.retrieve(distinct(i)):
                    pass
        expected = sorted((ctl.eviction_policy.key(n), n.id) for n in ctl.tree.nodes())
        order = []
        for _ in range(2000):
            assert await ctl.evictor.evict_device(1) == 1
            (page,) = ctl.device.allocator.allocate(1)  # the one free page: the victim's
            node = owner[page]
            order.append((ctl.eviction_policy.key(node), node.id))
        assert order == expected
