"""Nothing is lost on the way down: every page stored under write-through reaches every storage tier.

Tiers just big enough (the device holds one request, the host two), the real backend alone and
behind a slow link, stores back to back, then the cache is closed at once: the shutdown drain must
write what is still owed. A fresh cache then serves every prompt from storage alone, bit-exact.
"""

from __future__ import annotations

import anyio
import pytest

from hicache import HiCache

from ..helpers import assert_consistent
from .conftest import PAGE, Storage, make_kv, make_tokens, page_keys, pressure_config
from .reads import assert_view_equals

PROMPT_PAGES = 6
PROMPT_TOKENS = PROMPT_PAGES * PAGE + 5  # a partial last page, never stored
PROMPTS = 12


def prompts(seed: int = 0) -> list[tuple[list[int], object]]:
    return [(make_tokens(PROMPT_TOKENS, seed + i), make_kv(PROMPT_TOKENS, seed + i)) for i in range(PROMPTS)]


@pytest.mark.parametrize("slow", [False, True], ids=["real", "slowed"])
async def test_write_through_reaches_storage_and_a_fresh_cache_reads_it(storage: Storage, slow: bool) -> None:
    entry = storage.slowed() if slow else storage.entry
    config = pressure_config(8, 16, [entry], write="write_through", prefetch="wait_complete")
    work = prompts()
    async with HiCache.from_config(config) as cache:
        for tokens, kv in work:
            result = await cache.store(tokens, kv)
            assert result.stored_tokens == PROMPT_PAGES * PAGE and result.dropped_tokens == 0
        seed = cache.controller.tree.seed
    stats = cache.stats()
    assert stats.lost_pages == 0, f"pages lost on the way down: {dict((n, t.lost_pages) for n, t in stats.tiers.items())}"
    keys = [k for tokens, _ in work for k in page_keys(seed, tokens)]
    assert len(keys) == PROMPTS * PROMPT_PAGES
    assert await storage.count(keys) == len(keys), "a write-through page never reached storage"
    if storage.kind == "file":
        assert storage.files() == len(keys)

    # Another cache over the same storage (as another engine process would be) gets it all back.
    async with HiCache.from_config(pressure_config(8, 16, [storage.entry], prefetch="wait_complete")) as second:
        for tokens, kv in work:
            hit = await second.lookup(tokens)
            assert hit.tokens == PROMPT_PAGES * PAGE
            async with second.retrieve(tokens) as view:
                assert view.tokens == hit.tokens
                await assert_view_equals(view, kv)
        await second.wait_idle()
        assert_consistent(second)


@pytest.mark.parametrize("write", ["write_through", "write_back"])
async def test_closing_right_after_a_burst_drains_everything_owed(storage: Storage, write: str) -> None:
    """Concurrent stores, then leave ``async with`` at once: what was promised is written on the way out."""
    config = pressure_config(8, 16, [storage.slowed()], write=write)
    work = prompts(seed=100)
    async with HiCache.from_config(config) as cache:
        async with anyio.create_task_group() as tg:
            for tokens, kv in work:
                tg.start_soon(cache.store, tokens, kv)
        seed = cache.controller.tree.seed
    assert cache.stats().lost_pages == 0
    keys = [k for tokens, _ in work for k in page_keys(seed, tokens)]
    assert await storage.count(keys) == len(keys)


async def test_a_failing_write_is_counted_as_lost_never_silent(tmp_path) -> None:
    """When storage refuses writes, pages leave the host counted in ``lost_pages`` (and the cache goes on)."""
    entry = {"kind": "tests.fakes:FailingStorageBackend", "name": "down", "timeout_s": 1.0}
    config = pressure_config(8, 16, [entry], write="write_through")
    work = prompts(seed=200)
    async with HiCache.from_config(config) as cache:
        for tokens, kv in work:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        stats = cache.stats()
        assert stats.storage["down"].failures > 0
        evicted = stats.tiers["host"].evicted_pages
        assert evicted > 0 and stats.tiers["host"].lost_pages > 0
        # Lost pages are counted once, when they leave; the rest is counted when the cache closes.
        assert stats.tiers["host"].lost_pages <= evicted
    final = cache.stats()
    assert final.lost_pages == PROMPTS * PROMPT_PAGES
