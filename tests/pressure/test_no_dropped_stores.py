"""Stores never drop pages while a tier has room, even when they race each other.

Many tasks store prompts sharing a prefix at once; the prefix moves between tiers under them (the
device holds about one request), so a store finds its parent host-only by the time it inserts: its
pages must go to the host below that parent, not be thrown away.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from hicache import HiCache

from ..helpers import assert_consistent
from .conftest import PAGE, make_kv, make_tokens, pressure_config
from .reads import assert_view_equals

BASE_PAGES, OWN_PAGES, TASKS = 4, 3, 24


def shared_prefix_work(seed: int = 0) -> list[tuple[list[int], torch.Tensor]]:
    base, base_kv = make_tokens(BASE_PAGES * PAGE, 999 + seed), make_kv(BASE_PAGES * PAGE, 999 + seed)
    out = []
    for i in range(TASKS):
        own = make_tokens(OWN_PAGES * PAGE, seed * 100 + i)
        out.append((base + own, torch.cat([base_kv, make_kv(OWN_PAGES * PAGE, seed * 100 + i)], dim=2)))
    return out


@pytest.mark.parametrize("write", ["write_through", "write_through_selective", "write_back"])
async def test_concurrent_stores_sharing_a_prefix_drop_nothing(write: str) -> None:
    config = pressure_config(8, 256, write=write)
    work = shared_prefix_work()
    total = (BASE_PAGES + OWN_PAGES) * PAGE
    async with HiCache.from_config(config) as cache:
        short: list[int] = []

        async def one(tokens: list[int], kv: torch.Tensor) -> None:
            result = await cache.store(tokens, kv)
            assert result.dropped_tokens == 0, f"dropped {result.dropped_tokens} tokens with the host mostly free"
            assert result.stored_tokens + result.cached_tokens == total
            async with cache.retrieve(tokens) as view:
                if view.tokens < total:
                    short.append(total - view.tokens)
                await assert_view_equals(view, kv)

        async with anyio.create_task_group() as tg:
            for tokens, kv in work:
                tg.start_soon(one, tokens, kv)
        stats = cache.stats()
        assert stats.dropped_pages == 0
        # Shorter views only while the device was full of other tasks' leases, and all counted.
        assert stats.short_retrieves == len(short) and stats.short_retrieve_tokens == sum(short)
        if write != "write_through_selective":  # selective keeps cold pages on the device only
            for tokens, kv in work:  # afterwards, with nothing leased, every prompt comes back whole
                async with cache.retrieve(tokens) as view:
                    assert view.tokens == total
                    await assert_view_equals(view, kv)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_commit_under_a_host_only_prefix_lands_on_the_host() -> None:
    """The zero-copy path: pages reserved on the device and committed after their prefix left the
    device are copied to the host below it rather than dropped."""
    config = pressure_config(8, 64, write="write_through")
    prefix, prefix_kv = make_tokens(4 * PAGE, 1), make_kv(4 * PAGE, 1)
    rest_kv = make_kv(2 * PAGE, 2)
    tokens = prefix + make_tokens(2 * PAGE, 3)
    async with HiCache.from_config(config) as cache:
        await cache.store(prefix, prefix_kv)
        await cache.wait_idle()
        async with cache.reserve(2) as res:
            pool = cache.device_kv
            for j, page in enumerate(res.pages):
                pool[:, :, page] = rest_kv[:, :, j * PAGE : (j + 1) * PAGE].reshape(
                    2, 3, PAGE, 2, 16
                )
            await cache.controller.evictor.evict_device(cache.controller.device.num_pages)  # prefix: host only
            assert (await cache.lookup(prefix)).by_tier["host"] == 4 * PAGE
            added = await res.commit(tokens, first_page=4)
        assert added == 2 * PAGE and cache.stats().dropped_pages == 0
        async with cache.retrieve(tokens) as view:
            assert view.tokens == 6 * PAGE
            await assert_view_equals(view, torch.cat([prefix_kv, rest_kv], dim=2))
        await cache.wait_idle()
        assert_consistent(cache)
