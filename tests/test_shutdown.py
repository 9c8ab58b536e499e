"""Shutdown drains pending backups, bounded by the configured deadline."""

from __future__ import annotations

import time

import anyio

from hicache import HiCache

from .conftest import make_config, make_kv, make_tokens


async def test_close_drains_pending_backups() -> None:
    config = make_config(64, 64, controller={"backup_queue": 64})
    async with HiCache.from_config(config) as cache:
        for i in range(10):
            await cache.store(make_tokens(8, seed=i), make_kv(config, 8, seed=i))
        queued = cache.stats().in_flight
    stats = cache.stats()
    assert queued > 0, "the test wants backups still pending at close"
    assert stats.backups == 20 and stats.in_flight == 0
    assert stats.tiers["host"].used_pages == 20


async def test_close_gives_up_on_backups_after_the_deadline() -> None:
    config = make_config(64, 64, controller={"backup_queue": 64, "shutdown_timeout_s": 0.2})
    async with HiCache.from_config(config) as cache:
        original = cache.controller.engine.device_to_host

        def slow_backup(*args: object) -> None:
            time.sleep(1.0)  # a slow disk-backed host tier, say
            original(*args)

        cache.controller.engine.device_to_host = slow_backup  # type: ignore[method-assign]
        for i in range(6):
            await cache.store(make_tokens(8, seed=i), make_kv(config, 8, seed=i))
            await anyio.sleep(0.01)  # let the worker take the first job alone
        start = time.monotonic()
    elapsed = time.monotonic() - start
    # Without the deadline the two slow copies (one job, then a batch of five) would take 2 s. The copy that is
    # running when the deadline passes finishes (its pages are written in place), the rest are dropped.
    assert elapsed < 1.6
    assert cache.stats().backups < 12
