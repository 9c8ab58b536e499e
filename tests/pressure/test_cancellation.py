"""Cancellation at every await, under pressure: a cancelled store or retrieve never leaks a page, a
lease or a task, never loses a page it had placed, and the cache stays usable.

Each call is cancelled after ``k`` scheduler turns, for ``k = 0, 1, 2, ...`` until it completes
uncancelled, so every await inside it is hit once. Tiers are tight, the host <-> device link and the
storage tier are slowed, and write-through owes every page to the file tier.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
from dependency_injector import providers

from hicache.containers import Container

from ..fakes import SlowIOBackend
from ..helpers import assert_consistent
from .conftest import PAGE, Storage, page_keys, pressure_config
from .prefix_kv import prefix_kv
from .reads import assert_view_equals

MAX_TURNS = 150


async def cancelled_after(turns: int, fn: Callable[[], Awaitable[None]]) -> bool:
    """Run ``fn``, cancelling it after ``turns`` scheduler turns; True if it finished first.

    A turn is one pass of the event loop, so ``turns = 0, 1, 2, ...`` cancels it at each of its
    awaits in order (an await on a worker thread spans many turns).
    """
    finished = False
    with anyio.CancelScope() as scope:

        async def cancel_later() -> None:
            for _ in range(turns):
                await anyio.lowlevel.checkpoint()
            scope.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(cancel_later)
            await fn()
            finished = True
            tg.cancel_scope.cancel()
    return finished


async def cancel_at_every_await(fn: Callable[[], Awaitable[None]], before: Callable[[], Awaitable[None]]) -> int:
    """Cancel ``fn`` after 0, 1, 2, ... turns until it finishes; how many times it was cut off.

    Past ``MAX_TURNS`` (a slow machine: awaits on threads span many turns) it runs uncancelled.
    """
    for turns in range(MAX_TURNS):
        await before()
        if await cancelled_after(turns, fn):
            return turns
    await before()
    await fn()
    return MAX_TURNS


async def test_store_and_retrieve_cancelled_at_every_await(tmp_path) -> None:
    storage = Storage("file", {"kind": "file", "name": "store", "path": str(tmp_path / "pages"), "fsync": "never"},
                      tmp_path / "pages")
    config = pressure_config(6, 12, [storage.slowed()], write="write_through", prefetch="wait_complete")
    container = Container(config=config)
    container.io_backend.override(providers.Object(SlowIOBackend(0.001)))
    base = list(range(1, 2 * PAGE + 1))
    async with container.cache() as cache:
        for i in range(4):  # fill memory so every call below must evict, spill and wait
            warm = base + [50_000 + i * PAGE + j for j in range(3 * PAGE)]
            await cache.store(warm, prefix_kv(warm))
        tokens = base + [10_000 + j for j in range(3 * PAGE)]
        attempt = 0

        async def fresh_tokens() -> None:
            nonlocal tokens, attempt
            attempt += 1
            tokens = base + [10_000 + attempt * 100 + j for j in range(3 * PAGE)]

        async def store() -> None:
            await cache.store(tokens, prefix_kv(tokens))

        store_turns = await cancel_at_every_await(store, fresh_tokens)
        stored = tokens
        evictor = cache.controller.evictor

        async def only_in_storage() -> None:
            # Each try starts from storage alone: probe, prefetch, load-back, all awaited.
            await cache.wait_idle()
            await evictor.evict_device(cache.controller.device.num_pages)
            await evictor.evict_host(cache.controller.host.num_pages)

        async def retrieve() -> None:
            async with cache.retrieve(stored) as view:
                await assert_view_equals(view, prefix_kv(stored))

        retrieve_turns = await cancel_at_every_await(retrieve, only_in_storage)
        print(f"store finished after {store_turns} turns, retrieve after {retrieve_turns}")
        assert store_turns > 3 and retrieve_turns > 3, "the calls never awaited: nothing was cancelled inside them"
        await cache.wait_idle()
        assert_consistent(cache)
        seed = cache.controller.tree.seed
        # The cache still works after all those cancellations.
        hit = await cache.lookup(stored)
        async with cache.retrieve(stored) as view:
            assert view.tokens == hit.tokens == 5 * PAGE
    assert cache.stats().lost_pages == 0
    keys = page_keys(seed, stored)
    assert await storage.count(keys) == len(keys)
