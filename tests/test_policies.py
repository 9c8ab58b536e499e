"""Write and eviction policies: which pages are where after a scripted sequence."""

from __future__ import annotations

import pytest

from hicache import HiCache

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent

# One page = 4 tokens. Watermark eviction off (high = 1.0) so only allocation evicts.
NO_WATERMARK = {"high_watermark": 1.0, "low_watermark": 0.5}


def seq(name: int) -> list[int]:
    """A one-page sequence, distinct per name."""
    return [name] * 4


async def where(cache: HiCache, tokens: list[int]) -> str:
    hit = await cache.lookup(tokens)
    if hit.tokens == 0:
        return "-"
    return "device" if hit.by_tier["device"] else "host"


async def hit(cache: HiCache, tokens: list[int], times: int = 1) -> None:
    for _ in range(times):
        async with cache.retrieve(tokens) as view:
            await view.wait_all()


# -- write policies -----------------------------------------------------------------------------


async def test_write_through_backs_up_every_store() -> None:
    config = make_config(8, 16, policies={"write": "write_through"})
    async with HiCache.from_config(config) as cache:
        await cache.store(make_tokens(16), make_kv(config, 16))
        await cache.wait_idle()
        assert cache.controller.host.used_pages == 4
        assert cache.stats().backups == 4
        assert_consistent(cache)


async def test_write_through_selective_backs_up_after_threshold_hits() -> None:
    config = make_config(8, 16, policies={"write": "write_through_selective", "write_threshold": 2})
    tokens = make_tokens(8)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, make_kv(config, 8))
        await cache.wait_idle()
        assert cache.controller.host.used_pages == 0
        await hit(cache, tokens)  # 1 hit: below the threshold
        await cache.wait_idle()
        assert cache.controller.host.used_pages == 0
        await hit(cache, tokens)  # 2 hits: backed up
        await cache.wait_idle()
        assert cache.controller.host.used_pages == 2
        assert_consistent(cache)


async def test_write_through_selective_drops_cold_pages_on_eviction() -> None:
    config = make_config(2, 16, policies={"write": "write_through_selective"}, controller=NO_WATERMARK)
    async with HiCache.from_config(config) as cache:
        await cache.store(seq(1), make_kv(config, 4))
        await cache.store(seq(2), make_kv(config, 4))
        await cache.store(seq(3), make_kv(config, 4))  # evicts seq 1, never hit: gone
        await cache.wait_idle()
        assert [await where(cache, seq(i)) for i in (1, 2, 3)] == ["-", "device", "device"]
        assert cache.stats().spills == 0


async def test_write_back_spills_on_eviction_only() -> None:
    config = make_config(2, 16, policies={"write": "write_back"}, controller=NO_WATERMARK)
    kvs = {i: make_kv(config, 4, seed=i) for i in (1, 2, 3)}
    async with HiCache.from_config(config) as cache:
        await cache.store(seq(1), kvs[1])
        await cache.store(seq(2), kvs[2])
        await cache.wait_idle()
        assert cache.controller.host.used_pages == 0  # nothing written before eviction
        await cache.store(seq(3), kvs[3])  # evicts seq 1 -> spilled to host
        await cache.wait_idle()
        assert [await where(cache, seq(i)) for i in (1, 2, 3)] == ["host", "device", "device"]
        stats = cache.stats()
        assert stats.spills == 1 and stats.backups == 0
        async with cache.retrieve(seq(1)) as view:
            await view.wait_all()
            k, v = view.layer(2)
            assert (k == kvs[1][0, 2]).all() and (v == kvs[1][1, 2]).all()
        await cache.wait_idle()
        assert_consistent(cache)


# -- eviction policies --------------------------------------------------------------------------


async def _fill(cache: HiCache, config, names: list[int], priorities: dict[int, int] | None = None) -> None:
    for name in names:
        await cache.store(seq(name), make_kv(config, 4, seed=name), priority=(priorities or {}).get(name, 0))
    await cache.wait_idle()  # backups done: device pages are now evictable


async def _device_residents(cache: HiCache, names: list[int]) -> list[int]:
    return [n for n in names if await where(cache, seq(n)) == "device"]


@pytest.mark.parametrize(
    ("policy", "hits", "priorities", "evicted"),
    [
        ("lru", {1: 1, 3: 1, 4: 1}, None, 2),  # 2 is the least recently used
        ("lfu", {1: 2, 2: 3, 3: 1, 4: 2}, None, 3),  # 3 has the fewest hits
        ("fifo", {1: 5}, None, 1),  # 1 came first, hits do not matter
        ("priority", {1: 3}, {1: 1, 2: 5, 3: 3, 4: 2}, 1),  # 1 has the lowest priority
    ],
)
async def test_eviction_order(policy: str, hits: dict[int, int], priorities: dict[int, int] | None, evicted: int) -> None:
    config = make_config(4, 16, policies={"eviction": policy}, controller=NO_WATERMARK)
    async with HiCache.from_config(config) as cache:
        await _fill(cache, config, [1, 2, 3, 4], priorities)
        for name, times in hits.items():
            await hit(cache, seq(name), times)
        await cache.store(seq(5), make_kv(config, 4, seed=5), priority=9)  # needs one page
        await cache.wait_idle()
        assert await where(cache, seq(evicted)) == "host"
        assert sorted(await _device_residents(cache, [1, 2, 3, 4, 5])) == sorted({1, 2, 3, 4, 5} - {evicted})
        assert cache.stats().tiers["device"].evicted_pages == 1
        assert_consistent(cache)


async def test_leased_pages_are_never_evicted() -> None:
    config = make_config(4, 16, controller=NO_WATERMARK)
    async with HiCache.from_config(config) as cache:
        await _fill(cache, config, [1, 2, 3, 4])
        async with cache.retrieve(seq(1)) as view:
            freed = await cache.controller.evictor.evict_device(4)
            assert freed == 3
            assert await where(cache, seq(1)) == "device"
            assert all(cache.controller.device.allocator.is_allocated(p) for p in view.device_pages)
            await cache.controller.evictor.evict_host(16)
            assert await where(cache, seq(1)) == "device"
            assert_consistent(cache, [view._pin.node])
        assert await cache.controller.evictor.evict_device(4) == 1


async def test_host_keeps_pages_evicted_from_device_and_drops_least_valuable_when_full() -> None:
    config = make_config(2, 4, controller=NO_WATERMARK)
    async with HiCache.from_config(config) as cache:
        for name in range(1, 9):  # 8 pages through a 2-page device and a 4-page host
            await cache.store(seq(name), make_kv(config, 4, seed=name))
            await cache.wait_idle()
        places = {n: await where(cache, seq(n)) for n in range(1, 9)}
        # The newest two on the device (with host copies), the next newest host-only, oldest gone.
        assert [places[n] for n in (7, 8)] == ["device", "device"]
        assert [places[n] for n in (5, 6)] == ["host", "host"]
        assert all(places[n] == "-" for n in range(1, 5))
        assert cache.stats().tiers["host"].evicted_pages > 0
        assert_consistent(cache)


async def test_watermark_worker_evicts_in_background() -> None:
    config = make_config(10, 32, controller={"high_watermark": 0.5, "low_watermark": 0.2})
    async with HiCache.from_config(config) as cache:
        await cache.store(make_tokens(24), make_kv(config, 24))  # 6 pages > 5 = high watermark
        await cache.wait_idle()
        assert cache.controller.device.used_pages <= 2
        assert cache.controller.host.used_pages == 6
        assert (await cache.lookup(make_tokens(24))).tokens == 24
        assert_consistent(cache)


def _doc(name: int) -> list[int]:
    """A two-page document, distinct per name."""
    return [100 + name] * 4 + [200 + name] * 4


@pytest.mark.parametrize(("policy", "host_served_per_pass"), [("lru", 0), ("scan_resistant_lru", 2)])
async def test_a_loop_over_more_documents_than_the_host_holds(tmp_path, policy: str, host_served_per_pass: int) -> None:
    """Eight documents visited in turn, a host holding four: LRU evicts exactly the one asked for
    next (the host serves none of the loop); scan-resistant LRU lets each read-back displace the
    previous read-back, so the host keeps serving two of them: its four, less the room a read-back
    passes through and the copy of the document the device holds (host-only pages go first)."""
    config = make_config(
        2, 8, policies={"eviction": policy, "prefetch": "wait_complete"}, controller=NO_WATERMARK,
        tiers={"storage": [{"kind": "file", "path": str(tmp_path / "pages"), "fsync": "never"}]},
    )
    names = list(range(8))
    async with HiCache.from_config(config) as cache:
        for name in names:  # computed once, in order: the host keeps the last four
            await cache.store(_doc(name), make_kv(config, 8, seed=name))
            await cache.wait_idle()
        served = []
        for _ in range(3):
            host = 0
            for name in names:
                async with cache.retrieve(_doc(name)) as view:
                    await view.wait_all()
                    assert view.tokens == 8  # every document is found, from some tier
                    host += view.by_tier["host"] == 8
                await cache.wait_idle()
            served.append(host)
        assert served[1:] == [host_served_per_pass] * 2, served
        assert_consistent(cache)
