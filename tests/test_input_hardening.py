"""Arguments are checked before anything changes, and nothing but a typed error leaves a public call.

Each test here failed on the code before issue 11: a string priority was accepted and then killed
the eviction worker; a kv tensor that passes the shape and dtype checks but cannot be read (meta,
sparse) evicted device pages and counted a store before failing; ``reserve(n)`` larger than the
device evicted the whole tier before raising; a view or the device pool read after close raised a
bare ``RuntimeError``.
"""

from __future__ import annotations

import pytest

from hicache import HiCache
from hicache.errors import CacheClosedError, CapacityError, InvalidKVError, InvalidRequestError

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, snapshot


async def fill(cache: HiCache, n: int, tokens_per_prompt: int = 16) -> list[list[int]]:
    prompts = [make_tokens(tokens_per_prompt, seed=s) for s in range(n)]
    for seed, tokens in enumerate(prompts):
        await cache.store(tokens, make_kv(cache.config, tokens_per_prompt, seed=seed))
    await cache.wait_idle()
    return prompts


@pytest.mark.parametrize("priority", ["high", 1.5, None, True, [1]])
async def test_a_priority_that_is_not_an_int_is_refused_before_anything_changes(priority: object) -> None:
    config = make_config(8, 16, policies={"eviction": "priority"})
    async with HiCache.from_config(config) as cache:
        await fill(cache, 2)  # the device is full: the next store would evict
        before = snapshot(cache)
        tokens = make_tokens(16, seed=99)
        with pytest.raises(InvalidRequestError, match="priority"):
            await cache.store(tokens, make_kv(config, 16, seed=99), priority=priority)  # type: ignore[arg-type]
        async with cache.reserve(1) as res:
            with pytest.raises(InvalidRequestError, match="priority"):
                await res.commit(make_tokens(4, seed=5), priority=priority)  # type: ignore[arg-type]
        assert snapshot(cache) == before
        # The workers are alive: a later store evicts and succeeds.
        assert (await cache.store(tokens, make_kv(config, 16, seed=99), priority=3)).stored_tokens == 16
        await cache.wait_idle()
        assert_consistent(cache)


@pytest.mark.parametrize("make", [lambda kv: kv.to("meta"), lambda kv: kv.to_sparse()], ids=["meta", "sparse"])
async def test_a_kv_that_cannot_be_read_is_refused_before_any_eviction(make) -> None:
    config = make_config(8, 16)
    async with HiCache.from_config(config) as cache:
        await fill(cache, 2)
        before = snapshot(cache)
        with pytest.raises(InvalidKVError):
            await cache.store(make_tokens(16, seed=50), make(make_kv(config, 16, seed=50)))
        assert snapshot(cache) == before
        assert_consistent(cache)


async def test_reserve_larger_than_the_device_evicts_nothing() -> None:
    config = make_config(8, 16)
    async with HiCache.from_config(config) as cache:
        await fill(cache, 2)
        before = snapshot(cache)
        with pytest.raises(CapacityError, match="more pages than the device"):
            async with cache.reserve(9):
                pass
        assert snapshot(cache) == before


async def test_a_view_and_the_device_pool_after_close_raise_cache_closed() -> None:
    config = make_config(8, 16)
    cache = HiCache.from_config(config)
    async with cache:
        tokens = make_tokens(16, seed=1)
        await cache.store(tokens, make_kv(config, 16, seed=1))
        lease = cache.retrieve(tokens)
        view = await lease.__aenter__()
        await view.wait_all()
        assert view.layer(0)[0].shape[0] == 16
    try:
        with pytest.raises(CacheClosedError):
            view.layer(0)
        with pytest.raises(CacheClosedError):
            _ = cache.device_kv
    finally:
        await lease.__aexit__(None, None, None)


async def test_a_call_racing_a_dead_worker_gets_a_typed_error() -> None:
    """The backup worker's queue closed under a waiting store: WorkerFailedError or CacheClosedError,
    never anyio's BrokenResourceError."""
    config = make_config(8, 16, controller={"backup_queue": 1})
    async with HiCache.from_config(config) as cache:
        ctl = cache.controller
        await ctl._backup_send.aclose()  # as when the worker is gone
        with pytest.raises(CacheClosedError):
            await cache.store(make_tokens(16, seed=3), make_kv(config, 16, seed=3))
