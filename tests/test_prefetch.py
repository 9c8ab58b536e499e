"""Prefetch from storage: each policy, the timeout formula with a slowed backend, sharing, cancellation.

Pages are put "only in storage" by storing them (write-through reaches the storage tier), waiting
for the writes, then evicting device and host. The slowed backend (``tests.fakes.SlowStorageBackend``)
takes ``delay_s`` per page read, so arrival over time is predictable.
"""

from __future__ import annotations

import time

import anyio
import pytest
import torch

from hicache import HiCache
from hicache.policies.prefetch import BestEffort, Timeout, WaitComplete

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage

PAGES = 16


def slow_config(policy: str, delay_s: float = 0.05, **policies: object):
    cfg = make_config(32, 64, policies={"prefetch": policy, "prefetch_threshold_tokens": 8, **policies})
    return make_config(
        32, 64,
        tiers={"storage": [{"kind": "tests.fakes:SlowStorageBackend", "name": "slow", "delay_s": delay_s}]},
        policies={"prefetch": policy, "prefetch_threshold_tokens": 8, **policies},
        controller={"storage_batch_bytes": 2 * cfg.page_bytes},  # 2 pages per read: arrival is gradual
    )


async def stored_only_in_storage(cache: HiCache, tokens: list[int]) -> torch.Tensor:
    kv = make_kv(cache.config, len(tokens))
    await cache.store(tokens, kv)
    await push_to_storage(cache)
    return kv


def check_prefix(view, kv: torch.Tensor) -> None:
    for layer in range(kv.shape[1]):
        k, v = view.layer(layer)
        assert torch.equal(k, kv[0, layer, : view.tokens]) and torch.equal(v, kv[1, layer, : view.tokens])


def test_timeout_formula() -> None:
    policy = Timeout(base_s=2.0, per_ki_token_s=0.1, max_s=30.0)
    assert policy.wait_s(0) == 2.0
    assert policy.wait_s(10_240) == pytest.approx(3.0)
    assert policy.wait_s(10**7) == 30.0  # capped
    assert BestEffort().wait_s(10**6) == 0
    assert WaitComplete().wait_s(1) == float("inf")


async def test_lookup_reports_storage_and_starts_a_prefetch() -> None:
    async with HiCache.from_config(slow_config("wait_complete", delay_s=0.0)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        hit = await cache.lookup(tokens)
        assert hit.tokens == len(tokens) and hit.by_tier["slow"] == len(tokens)
        assert hit.prefetch is not None
        assert await hit.prefetch.wait() == len(tokens)
        assert cache.stats().tiers["host"].used_pages == PAGES  # now in host memory
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == len(tokens)
            assert dict(view.by_tier) == {"device": 0, "host": 0, "slow": len(tokens)}
            check_prefix(view, kv)
        stats = cache.stats()
        assert stats.prefetches == 1 and stats.prefetched_pages == PAGES
        assert stats.storage["slow"].hit_tokens == len(tokens)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_wait_complete_waits_for_every_page() -> None:
    async with HiCache.from_config(slow_config("wait_complete", delay_s=0.02)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        async with cache.retrieve(tokens) as view:  # no lookup first: retrieve starts the prefetch
            await view.wait_all()
            assert view.tokens == len(tokens)
            check_prefix(view, kv)


async def test_best_effort_takes_only_what_has_arrived() -> None:
    async with HiCache.from_config(slow_config("best_effort", delay_s=0.05)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        async with cache.retrieve(tokens) as view:  # nothing started it: nothing arrived
            assert view.tokens == 0
        hit = await cache.lookup(tokens)  # an engine looks up at enqueue time...
        assert hit.prefetch is not None
        await anyio.sleep(0.35)  # ...and schedules the request a while later
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert 0 < view.tokens < len(tokens)
            check_prefix(view, kv)
        await cache.wait_idle()
        assert hit.prefetch.done and hit.prefetch.cancelled  # the retrieve ended it
        assert_consistent(cache)


async def test_timeout_policy_waits_by_the_formula() -> None:
    # 16 pages of 4 tokens at 0.1 s a page take 1.6 s; the policy allows 0.3 + 3.2 * 64 / 1024 = 0.5 s.
    config = slow_config("timeout", delay_s=0.1, prefetch_timeout={"base_s": 0.3, "per_ki_token_s": 3.2, "max_s": 30})
    async with HiCache.from_config(config) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        start = time.monotonic()
        async with cache.retrieve(tokens) as view:
            waited = time.monotonic() - start
            await view.wait_all()
            assert 0.45 <= waited < 1.2
            # About 4-5 pages arrived in 0.5 s, two at a time.
            assert 2 * cache.page_size <= view.tokens <= 8 * cache.page_size
            check_prefix(view, kv)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_timeout_is_capped_by_max_s() -> None:
    config = slow_config("timeout", delay_s=0.1, prefetch_timeout={"base_s": 5, "per_ki_token_s": 5, "max_s": 0.25})
    async with HiCache.from_config(config) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        await stored_only_in_storage(cache, tokens)
        start = time.monotonic()
        async with cache.retrieve(tokens) as view:
            assert 0.2 <= time.monotonic() - start < 0.9
            assert view.tokens < len(tokens)


async def test_concurrent_requests_share_one_prefetch() -> None:
    async with HiCache.from_config(slow_config("wait_complete", delay_s=0.01)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        before = cache.stats().prefetches
        seen: list[int] = []

        async def request() -> None:
            async with cache.retrieve(tokens) as view:
                await view.wait_all()
                check_prefix(view, kv)
                seen.append(view.tokens)

        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            tg.start_soon(request)
        assert cache.stats().prefetches - before == 1
        assert max(seen) == len(tokens)


async def test_cancelling_a_request_cancels_its_prefetch_and_frees_host_pages() -> None:
    async with HiCache.from_config(slow_config("wait_complete", delay_s=0.05)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        await stored_only_in_storage(cache, tokens)
        with anyio.move_on_after(0.3) as scope:
            async with cache.retrieve(tokens):
                raise AssertionError("the retrieve should still be waiting for storage")
        assert scope.cancelled_caught
        await cache.wait_idle()  # the prefetch ended: nothing is left running
        assert not cache.controller.prefetcher.running
        stats = cache.stats()
        assert 0 < stats.prefetched_pages < PAGES  # stopped early
        # Every host page in use belongs to a published node: the batch in flight was freed.
        assert stats.tiers["host"].used_pages == stats.prefetched_pages
        assert_consistent(cache)


async def test_dropping_a_request_before_it_runs_cancels_the_lookup_prefetch() -> None:
    async with HiCache.from_config(slow_config("timeout", delay_s=0.05)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        await stored_only_in_storage(cache, tokens)
        hit = await cache.lookup(tokens)
        assert hit.prefetch is not None
        await anyio.sleep(0.12)
        hit.prefetch.cancel()
        await cache.wait_idle()
        assert hit.prefetch.done and hit.prefetch.arrived_tokens < len(tokens)
        assert cache.stats().tiers["host"].used_pages == hit.prefetch.arrived_tokens // cache.page_size
        assert_consistent(cache)


async def test_below_the_threshold_lookup_starts_nothing_but_retrieve_still_fetches() -> None:
    """The threshold keeps ``lookup`` from starting background work for a few pages; a retrieve
    that needs them (``wait_complete``) still brings them, so it gives what lookup found."""
    config = slow_config("wait_complete", delay_s=0.0, prefetch_threshold_tokens=10_000)
    async with HiCache.from_config(config) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        hit = await cache.lookup(tokens)
        assert hit.by_tier["slow"] == len(tokens) and hit.prefetch is None
        assert cache.stats().prefetches == 0
        async with cache.retrieve(tokens) as view:
            assert view.tokens == hit.tokens
            await view.wait_all()
            assert torch.equal(view.layer(0)[0], kv[0, 0])
        assert cache.stats().prefetches == 1


async def test_below_the_threshold_best_effort_retrieve_fetches_nothing() -> None:
    config = slow_config("best_effort", delay_s=0.0, prefetch_threshold_tokens=10_000)
    async with HiCache.from_config(config) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        await stored_only_in_storage(cache, tokens)
        async with cache.retrieve(tokens) as view:
            assert view.tokens == 0  # best effort: only what a lookup already started can help
        assert cache.stats().prefetches == 0


async def test_prefetch_continues_after_a_memory_prefix() -> None:
    async with HiCache.from_config(slow_config("wait_complete", delay_s=0.0)) as cache:
        tokens = make_tokens(PAGES * cache.page_size)
        kv = await stored_only_in_storage(cache, tokens)
        half = len(tokens) // 2
        await cache.store(tokens[:half], kv[:, :, :half])  # the first half is back in memory
        hit = await cache.lookup(tokens)
        assert hit.by_tier["device"] == half and hit.by_tier["slow"] == len(tokens) - half
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == len(tokens)
            assert view.by_tier["slow"] == len(tokens) - half
            check_prefix(view, kv)
