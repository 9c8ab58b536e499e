"""Layer-wise load-back, cancellation and worker failure, with fault-injecting io backends."""

from __future__ import annotations

import anyio
import pytest
import torch
from dependency_injector import providers

from hicache import HiCache, WorkerFailedError
from hicache.containers import Container

from .conftest import make_config, make_kv, make_tokens
from .fakes import FailingIOBackend, StallingIOBackend
from .helpers import assert_consistent

NUM_LAYERS = 4


def build(config, io_backend) -> HiCache:
    container = Container(config=config)
    container.io_backend.override(providers.Object(io_backend))
    return container.cache()


async def put_on_host_only(cache: HiCache, tokens: list[int], kv: torch.Tensor) -> None:
    """Store, back up, then evict from the device so the next retrieve must load from host."""
    await cache.store(tokens, kv)
    await cache.wait_idle()
    await cache.controller.evictor.evict_device(cache.controller.device.num_pages)
    assert (await cache.lookup(tokens)).by_tier["host"] == len(tokens)


async def test_layer_zero_is_readable_before_the_last_layer_arrives() -> None:
    config = make_config(16, 32)
    stall = StallingIOBackend(stall_layer=NUM_LAYERS - 1)
    tokens, kv = make_tokens(16), make_kv(config, 16)
    async with build(config, stall) as cache:
        await put_on_host_only(cache, tokens, kv)
        async with cache.retrieve(tokens) as view:
            assert view.by_tier == {"device": 0, "host": 16}
            with anyio.fail_after(10):
                await view.wait_layer(0)
            k0, v0 = view.layer(0)
            assert torch.equal(k0, kv[0, 0]) and torch.equal(v0, kv[1, 0])
            await anyio.to_thread.run_sync(stall.stalled.wait, 10)
            assert not view.is_layer_ready(NUM_LAYERS - 1)
            assert NUM_LAYERS - 1 not in stall.layers_copied
            with pytest.raises(Exception, match="has not arrived"):
                view.layer(NUM_LAYERS - 1)
            stall.release()
            with anyio.fail_after(10):
                await view.wait_layer(NUM_LAYERS - 1)
            k, v = view.layer(NUM_LAYERS - 1)
            assert torch.equal(k, kv[0, -1]) and torch.equal(v, kv[1, -1])
        await cache.wait_idle()
        assert_consistent(cache)


async def test_cancelled_retrieve_mid_transfer_releases_everything() -> None:
    config = make_config(16, 32)
    stall = StallingIOBackend(stall_layer=1)
    tokens, kv = make_tokens(16), make_kv(config, 16)
    async with build(config, stall) as cache:
        await put_on_host_only(cache, tokens, kv)
        with anyio.CancelScope() as scope:
            async with cache.retrieve(tokens) as view:
                await view.wait_layer(0)
                await anyio.to_thread.run_sync(stall.stalled.wait, 10)
                scope.cancel()
                await view.wait_layer(NUM_LAYERS - 1)  # cancelled here, mid-transfer
        assert scope.cancelled_caught
        # The lease is gone at once; the transfer's own pin goes when the copy thread returns.
        assert cache.controller.tree.root.lock_ref == 2
        stall.release()
        with anyio.fail_after(10):
            await cache.wait_idle()
        assert_consistent(cache)  # no lease, page or job left behind
        # The pages that did arrive are usable by the next caller.
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert torch.equal(view.layer(3)[0], kv[0, 3])


async def test_cancel_while_waiting_for_a_full_backup_queue() -> None:
    """A store blocked on backpressure is cancelled: its pages stay cached, nothing leaks."""
    config = make_config(32, 64, controller={"backup_queue": 1})
    async with HiCache.from_config(config) as cache:
        with anyio.move_on_after(0.5):
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(cache.store, make_tokens(8, seed=i), make_kv(config, 8, seed=i))
                await anyio.sleep(0)
                tg.cancel_scope.cancel()
        with anyio.fail_after(10):
            await cache.wait_idle()
        assert_consistent(cache)


async def test_failed_store_copy_leaves_the_cache_unchanged() -> None:
    config = make_config(16, 32)
    failing = FailingIOBackend()
    tokens = make_tokens(8)
    async with build(config, failing) as cache:
        failing.armed = True
        with pytest.raises(OSError, match="injected"):
            await cache.store(tokens, make_kv(config, 8))
        failing.armed = False
        assert (await cache.lookup(tokens)).tokens == 0
        assert cache.controller.device.used_pages == 0 and cache.controller.host.used_pages == 0
        assert_consistent(cache)
        await cache.store(tokens, make_kv(config, 8))  # the cache still works
        assert (await cache.lookup(tokens)).tokens == 8


async def test_backup_worker_failure_surfaces_and_later_calls_raise() -> None:
    config = make_config(16, 32)
    failing = FailingIOBackend()
    seen: list[BaseException] = []
    with pytest.raises(WorkerFailedError) as info:
        async with build(config, failing) as cache:
            await cache.store(make_tokens(8), make_kv(config, 8))
            await cache.wait_idle()
            # Make only the background copy fail: arm between the store's copy and the backup.
            original = cache.controller.engine.device_to_host

            def failing_backup(*args: object) -> None:
                raise OSError("disk on fire")

            cache.controller.engine.device_to_host = failing_backup  # type: ignore[method-assign]
            try:
                await cache.store(make_tokens(8, seed=9), make_kv(config, 8, seed=9))
                await anyio.sleep(5)  # the task group cancels this when the worker dies
            except BaseException as exc:  # noqa: BLE001 - recording what the body saw
                seen.append(exc)
                raise
            finally:
                cache.controller.engine.device_to_host = original  # type: ignore[method-assign]
                with pytest.raises(WorkerFailedError):
                    await cache.lookup(make_tokens(8))
    assert "backup" in str(info.value) and isinstance(info.value.__cause__, OSError)
    assert seen and isinstance(seen[0], anyio.get_cancelled_exc_class())
