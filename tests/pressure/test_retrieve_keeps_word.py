"""``retrieve`` gives what ``lookup`` found whenever the device can hold it.

The device holds little more than one request; the link between host and device is slowed
(``tests.fakes.SlowIOBackend``), so load-backs, backups and spills are still in flight when the next
call comes. A retrieve must wait for them rather than serve a shorter prefix; a shorter one is only
allowed when the device is full of leased pages, and then it is counted (``short_retrieves``).
"""

from __future__ import annotations

import anyio
import pytest
from dependency_injector import providers

from hicache.containers import Container

from ..fakes import SlowIOBackend
from ..helpers import assert_consistent
from .conftest import PAGE, Storage, make_kv, make_tokens, pressure_config
from .reads import assert_view_equals

WRITES = ["write_through", "write_through_selective", "write_back"]


def slowed_cache(config, delay_s: float = 0.002):
    container = Container(config=config)
    container.io_backend.override(providers.Object(SlowIOBackend(delay_s)))
    return container.cache()


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("read_layers", [True, False], ids=["read", "released-early"])
async def test_sequential_retrieves_match_lookup(write: str, read_layers: bool) -> None:
    config = pressure_config(6, 128, write=write)
    work = [(make_tokens(4 * PAGE, i), make_kv(4 * PAGE, i)) for i in range(10)]
    async with slowed_cache(config) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
        for tokens, kv in work:
            hit = await cache.lookup(tokens)
            # Selective write-through keeps cold pages on the device only: those may go.
            assert hit.tokens == 4 * PAGE or write == "write_through_selective"
            async with cache.retrieve(tokens) as view:
                assert view.tokens == hit.tokens
                if read_layers:
                    await assert_view_equals(view, kv)
        stats = cache.stats()
        assert stats.short_retrieves == 0 and stats.lost_pages == 0
        if write != "write_through_selective":
            assert stats.tiers["host"].miss_tokens == 0  # every token came from device or host
        await cache.wait_idle()
        assert_consistent(cache)


async def test_retrieve_waits_for_storage_pages_under_wait_complete(storage: Storage) -> None:
    """With pages in storage only, lookup's figure includes them, and retrieve brings them all."""
    config = pressure_config(6, 8, [storage.slowed()], write="write_through", prefetch="wait_complete")
    work = [(make_tokens(4 * PAGE, 50 + i), make_kv(4 * PAGE, 50 + i)) for i in range(8)]
    async with slowed_cache(config) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        for tokens, kv in work:
            hit = await cache.lookup(tokens)
            assert hit.tokens == 4 * PAGE
            async with cache.retrieve(tokens) as view:
                assert view.tokens == hit.tokens
                await assert_view_equals(view, kv)
        assert cache.stats().short_retrieves == 0
        await cache.wait_idle()
        assert_consistent(cache)


async def test_a_short_retrieve_happens_only_when_the_device_is_leased_full_and_is_counted() -> None:
    config = pressure_config(6, 64, write="write_through")
    work = [(make_tokens(4 * PAGE, 80 + i), make_kv(4 * PAGE, 80 + i)) for i in range(3)]
    async with slowed_cache(config) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        async with cache.retrieve(work[2][0]) as held:  # 4 of the 6 device pages leased
            assert held.tokens == 4 * PAGE
            async with cache.retrieve(work[0][0]) as view:
                assert view.tokens == 2 * PAGE  # room for two pages only
                await assert_view_equals(view, work[0][1])
        stats = cache.stats()
        assert stats.short_retrieves == 1 and stats.short_retrieve_tokens == 2 * PAGE


async def test_concurrent_retrieves_of_distinct_prompts_all_complete_when_the_device_can_hold_each() -> None:
    """A burst of retrieves, each fitting the device alone: they queue for room, none comes back short
    unless the device is full of leases at that moment (counted), and every byte is right."""
    config = pressure_config(8, 128, write="write_back")
    work = [(make_tokens(4 * PAGE, 120 + i), make_kv(4 * PAGE, 120 + i)) for i in range(12)]
    async with slowed_cache(config) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
        lengths: list[int] = []

        async def one(tokens: list[int], kv: object) -> None:
            async with cache.retrieve(tokens) as view:
                lengths.append(view.tokens)
                await assert_view_equals(view, kv)

        async with anyio.create_task_group() as tg:
            for tokens, kv in work:
                tg.start_soon(one, tokens, kv)
        stats = cache.stats()
        short = sum(1 for n in lengths if n < 4 * PAGE)
        assert short == stats.short_retrieves
        assert stats.short_retrieve_tokens == sum(4 * PAGE - n for n in lengths)
        await cache.wait_idle()
        assert_consistent(cache)
