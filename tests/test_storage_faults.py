"""A storage backend that raises, hangs or fails writes: requests keep being served from memory.

The fakes (``tests/fakes.py``) inject the faults; the rest of the cache is real. Nothing may crash,
hang past ``timeout_s``, or record a failed write as stored.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from hicache import HiCache, StorageBackendError, StorageTimeoutError

from .conftest import make_config, make_kv, make_tokens
from .fakes import FailingStorageBackend, StallingStorageBackend
from .helpers import assert_consistent, push_to_storage


def faulty_config(kind: str, **tier: object):
    return make_config(
        8, 16,
        tiers={"storage": [{"kind": f"tests.fakes:{kind}", "name": "bad", **tier}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


async def test_backend_errors_are_typed_and_counted() -> None:
    async with FailingStorageBackend() as backend:
        with pytest.raises(StorageBackendError) as info:
            await backend.exists([bytes(16)])
        assert isinstance(info.value.__cause__, ConnectionError)
        assert backend.stats().errors == 1
    async with StallingStorageBackend(timeout_s=0.05) as backend:
        start = time.monotonic()
        with pytest.raises(StorageTimeoutError):
            await backend.exists([bytes(16)])
        assert time.monotonic() - start < 1.0
        assert backend.stats().timeouts == 1


async def test_a_backend_that_always_raises_never_fails_a_request(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hicache.tiers.storage.tier")
    async with HiCache.from_config(faulty_config("FailingStorageBackend")) as cache:
        tokens = make_tokens(6 * cache.page_size)
        kv = make_kv(cache.config, len(tokens))
        result = await cache.store(tokens, kv)
        assert result.stored_tokens == len(tokens)
        await cache.wait_idle()
        hit = await cache.lookup(tokens + make_tokens(8 * cache.page_size, seed=5))
        assert hit.tokens == len(tokens) and hit.prefetch is None
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == len(tokens)
            k, v = view.layer(0)
            assert torch.equal(k, kv[0, 0]) and torch.equal(v, kv[1, 0])
        await cache.wait_idle()
        stats = cache.stats().storage["bad"]
        assert stats.failures >= 2 and stats.backend.errors >= 2
        assert stats.stored_pages == 0
        assert not any(nd.stored for nd in cache.controller.tree.nodes())  # failed writes are not "stored"
        assert_consistent(cache)
    # One warning when the tier went down, not one per failed call.
    assert len([r for r in caplog.records if r.name == "hicache.tiers.storage.tier"]) == 1


async def test_a_hanging_backend_is_bounded_by_its_timeout() -> None:
    async with HiCache.from_config(faulty_config("StallingStorageBackend", timeout_s=0.2)) as cache:
        tokens = make_tokens(4 * cache.page_size)
        await cache.store(tokens, make_kv(cache.config, len(tokens)))
        start = time.monotonic()
        await cache.wait_idle()  # the backup to storage times out
        hit = await cache.lookup(make_tokens(8 * cache.page_size, seed=3))  # exists times out: a miss
        async with cache.retrieve(make_tokens(8 * cache.page_size, seed=4)) as view:
            assert view.tokens == 0
        assert time.monotonic() - start < 2.0
        assert hit.tokens == 0
        assert cache.stats().storage["bad"].backend.timeouts >= 3
        assert_consistent(cache)


async def test_a_failed_write_is_never_recorded_as_present() -> None:
    async with HiCache.from_config(faulty_config("FlakyStorageBackend")) as cache:
        backend = cache.controller.storage[0].backend
        prompts = [make_tokens(2 * cache.page_size, seed=s) for s in range(6)]
        for tokens in prompts:
            await cache.store(tokens, make_kv(cache.config, len(tokens), seed=1))
            await cache.wait_idle()  # one write (one set call) per prompt
        assert backend.set_calls == 6
        present = [await backend.exists(_keys(cache, t)) for t in prompts]
        assert present == [2, 0, 2, 0, 2, 0]  # every other write failed and left nothing behind
        stored = {nd.keys[0]: nd.stored for nd in cache.controller.tree.nodes()}
        assert [stored[_keys(cache, t)[0]] for t in prompts] == [True, False] * 3
        await push_to_storage(cache)
        async with cache.retrieve(prompts[1]) as view:
            assert view.tokens == 0  # its write failed: a miss, not garbage
        async with cache.retrieve(prompts[2]) as view:
            await view.wait_all()
            assert view.tokens == len(prompts[2])


def _keys(cache: HiCache, tokens: list[int]) -> list[bytes]:
    from hicache.keys import as_token_bytes, chain_keys

    return chain_keys(cache.namespace.digest, as_token_bytes(tokens), cache.page_size)


async def test_busy_seconds_count_overlapping_calls_once() -> None:
    """Two reads in flight at once: ``seconds`` adds both calls' time, ``busy_seconds`` the wall
    time with a read in flight (what a bandwidth is measured against); one read alone: equal."""
    import anyio
    import numpy as np

    from hicache.tiers.storage import HEADER_BYTES, PageIO

    from .fakes import SlowStorageBackend

    def page() -> PageIO:
        return PageIO.of(np.zeros(HEADER_BYTES, np.uint8), np.zeros(64, np.uint8))

    async with SlowStorageBackend(delay_s=0.2) as backend:
        keys = [bytes([i]) * 16 for i in range(2)]
        assert await backend.set(keys, [page(), page()]) == 2
        async with anyio.create_task_group() as tg:
            for k in keys:
                tg.start_soon(backend.get, [k], [page()])
        stats = backend.stats()
        assert stats.seconds["get"] >= 0.39
        # the overlap counted once (bounds loose enough for a loaded machine)
        assert 0.19 <= stats.busy_seconds["get"] < 0.75 * stats.seconds["get"]
        await backend.get(keys[:1], [page()])
        after = backend.stats()
        alone_seconds = after.seconds["get"] - stats.seconds["get"]
        alone_busy = after.busy_seconds["get"] - stats.busy_seconds["get"]
        assert alone_busy == pytest.approx(alone_seconds, abs=1e-6)
