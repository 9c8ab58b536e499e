"""``HiCache.persist``: a prefix made durable in one storage tier, as that tier answers.

What a prefill server waits for before it reports a prompt's KV sent (the vLLM connector's
``kv_producer`` role): pages no write policy owed yet are written, writes in flight are waited
for, pages the tier lost after they were written are written again, and a tier whose writes
fail answers short, within the caller's bound.
"""

from __future__ import annotations

import anyio
import pytest

from hicache import ConfigError, HiCache

from .conftest import make_config, make_kv, make_tokens


def _config(tmp_path, write: str = "write_through", storage: list | None = None):
    return make_config(
        8, 32,
        tiers={"storage": storage or [{"kind": "memory", "name": "mem"}, {"kind": "file", "path": str(tmp_path), "name": "shared"}]},
        policies={"write": write},
    )


async def test_persist_waits_for_the_writes_and_answers_what_the_tier_holds(tmp_path) -> None:
    config = _config(tmp_path)
    ps = config.page_size
    tokens, kv = make_tokens(6 * ps + 3), make_kv(config, 6 * ps + 3)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        shared = cache.controller.storage[1]
        assert await cache.persist(tokens, tier="shared") == 6 * ps  # whole pages only
        assert await shared.exists(cache.controller.tree.match(tokens_bytes(tokens)).path[-1].keys) >= 1
        assert cache.controller.storage_jobs.count == 0
        # Nothing cached past what was stored: a longer prompt persists only its cached prefix.
        assert await cache.persist(tokens + make_tokens(2 * ps, seed=5), tier="shared") == 6 * ps


async def test_persist_writes_what_the_write_policy_did_not_owe(tmp_path) -> None:
    # write_back: pages go to storage only when they leave memory; persist writes them now.
    config = _config(tmp_path, write="write_back")
    ps = config.page_size
    tokens, kv = make_tokens(4 * ps), make_kv(config, 4 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        shared = cache.controller.storage[1]
        assert shared.stored_pages == 0
        assert await cache.persist(tokens) == 4 * ps  # default: the first tier that takes writes
        assert await cache.persist(tokens, tier="shared") == 4 * ps


async def test_pages_the_tier_lost_are_written_again(tmp_path) -> None:
    config = _config(tmp_path)
    ps = config.page_size
    tokens, kv = make_tokens(5 * ps), make_kv(config, 5 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        assert await cache.persist(tokens, tier="mem") == 5 * ps
        mem = cache.controller.storage[0]
        await mem.backend.clear()  # flushed under the cache: its index still says "stored"
        assert await mem.exists([b"x" * 16]) == 0
        assert await cache.persist(tokens, tier="mem") == 5 * ps
        assert mem.stored_pages >= 10


async def test_a_tier_whose_writes_fail_answers_short(tmp_path) -> None:
    config = _config(tmp_path, storage=[{"kind": "tests.fakes:FailingStorageBackend", "name": "broken"}])
    ps = config.page_size
    tokens, kv = make_tokens(3 * ps), make_kv(config, 3 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        with anyio.fail_after(10):
            assert await cache.persist(tokens, tier="broken") == 0  # a miss, counted by the tier; no error
            started = anyio.current_time()
            assert await cache.persist(tokens, tier="broken", retry_s=1.0) == 0
            assert 0.3 < anyio.current_time() - started < 3.0  # tried again for about retry_s, then answered
        with pytest.raises(ConfigError):
            await cache.persist(tokens, tier="nowhere")


async def test_writes_a_tier_refused_are_tried_again_within_retry_s(tmp_path) -> None:
    storage = [{"kind": "tests.fakes:FailingFirstCallsStorageBackend", "name": "moody", "inner": {"kind": "memory"},
                "write_failures": 2}]
    config = _config(tmp_path, write="write_back", storage=storage)
    ps = config.page_size
    tokens, kv = make_tokens(3 * ps), make_kv(config, 3 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        tier = cache.controller.storage[0]
        assert await cache.persist(tokens) == 0  # refused once, not tried again without retry_s
        assert tier.backend.set_calls == 1
        started = anyio.current_time()
        with anyio.fail_after(10):
            assert await cache.persist(tokens, retry_s=5.0) == 3 * ps  # refused once more, then taken
        assert tier.backend.set_calls == 3
        assert anyio.current_time() - started < 2.0  # after a short back-off, not at the bound
        assert await tier.exists(cache.controller.tree.match(tokens_bytes(tokens)).path[-1].keys) >= 1


async def test_a_stalled_tier_is_bounded_by_the_caller(tmp_path) -> None:
    config = _config(tmp_path, storage=[{"kind": "tests.fakes:StallingStorageBackend", "name": "stalled"}])
    config = config.model_copy(update={"controller": config.controller.model_copy(update={"shutdown_timeout_s": 0.5})})
    ps = config.page_size
    tokens, kv = make_tokens(3 * ps), make_kv(config, 3 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        with anyio.move_on_after(0.5) as scope:
            await cache.persist(tokens, tier="stalled")
        assert scope.cancelled_caught  # the caller's bound ends it; nothing raises


def tokens_bytes(tokens: list[int]) -> bytes:
    from hicache.keys import as_token_bytes

    return as_token_bytes(tokens)
