"""The engine-level zero-copy path, the composition root, and the GPU path (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch
from dependency_injector import providers

from hicache import CapacityError, HiCache, InvalidRequestError, InvalidTokensError
from hicache.containers import Container
from hicache.io.direct import DirectIOBackend
from hicache.policies import LFUPolicy, WriteBack

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent


async def test_reserve_write_in_place_commit_then_retrieve_zero_copy() -> None:
    config = make_config(16, 32)
    tokens, kv = make_tokens(16), make_kv(config, 16)
    async with HiCache.from_config(config) as cache:
        pool = cache.device_kv  # [C, L, pages, page_size, H, D]
        async with cache.reserve(4) as reservation:
            # The engine writes KV straight into the pool's pages (here: from a reference tensor).
            for i, page in enumerate(reservation.pages):
                pool[:, :, page] = kv[:, :, i * 4 : (i + 1) * 4]
            assert await reservation.commit(tokens) == 16
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            flat = pool.view(pool.shape[0], pool.shape[1], -1, pool.shape[4], pool.shape[5])
            assert torch.equal(flat[:, :, view.slot_indices], kv)  # read in place, no copy by hicache
        await cache.wait_idle()
        assert_consistent(cache)


async def test_uncommitted_reservation_is_freed_and_commit_skips_cached_pages() -> None:
    config = make_config(8, 32)
    tokens, kv = make_tokens(16), make_kv(config, 16)
    async with HiCache.from_config(config) as cache:
        async with cache.reserve(3) as reservation:
            assert cache.controller.device.used_pages == 3
        assert cache.controller.device.used_pages == 0
        await cache.store(tokens[:8], kv[:, :, :8])
        async with cache.reserve(4) as reservation:
            # Pages 0-1 are cached already: only 2-3 are added; the rest are freed.
            assert await reservation.commit(tokens) == 8
        await cache.wait_idle()
        assert cache.controller.device.used_pages == 4
        assert_consistent(cache)
        with pytest.raises(CapacityError):
            async with cache.reserve(100):
                pass


async def test_container_selects_and_overrides_components() -> None:
    config = make_config(policies={"write": "write_back", "eviction": "lfu"}, io={"backend": "direct"})
    container = Container(config=config)
    cache = container.cache()
    assert isinstance(cache.controller.write_policy, WriteBack)
    assert isinstance(cache.controller.eviction_policy, LFUPolicy)
    assert isinstance(cache.controller.engine.io, DirectIOBackend)
    # Two caches never share a pool.
    assert HiCache.from_config(config).controller.device is not cache.controller.device
    other = Container(config=config)
    sentinel = DirectIOBackend()
    with other.io_backend.override(providers.Object(sentinel)):
        assert other.cache().controller.engine.io is sentinel


def test_only_the_composition_root_imports_dependency_injector() -> None:
    from pathlib import Path

    import hicache

    root = Path(hicache.__file__).parent
    users = sorted(p.name for p in root.rglob("*.py") if "dependency_injector" in p.read_text())
    assert users == ["containers.py"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("io", ["kernel", "direct"])
async def test_cuda_round_trip_through_host(io: str) -> None:
    config = make_config(8, 64, tiers={"device": {"device": "cuda"}}, io={"backend": io})
    seqs = [(make_tokens(16, seed=s), make_kv(config, 16, seed=s)) for s in range(6)]
    async with HiCache.from_config(config) as cache:
        assert cache.device_kv.is_cuda and cache.controller.host.pin_memory
        for tokens, kv in seqs:
            await cache.store(tokens, kv.cuda())
        await cache.wait_idle()
        for tokens, kv in seqs:
            async with cache.retrieve(tokens) as view:
                for layer in range(4):
                    await view.wait_layer(layer)
                    k, v = view.layer(layer)
                    assert k.is_cuda and torch.equal(k.cpu(), kv[0, layer]) and torch.equal(v.cpu(), kv[1, layer])
        await cache.wait_idle()
        assert_consistent(cache)


async def test_commit_with_bad_tokens_keeps_the_reservation() -> None:
    config = make_config(8, 32)
    async with HiCache.from_config(config) as cache:
        async with cache.reserve(2) as reservation:
            with pytest.raises(InvalidTokensError):
                await reservation.commit([1, -1, 2, 3])
            with pytest.raises(InvalidRequestError, match="first_page"):
                await reservation.commit(make_tokens(8), first_page=-1)
            assert cache.controller.device.used_pages == 2
            assert await reservation.commit(make_tokens(8)) == 8
            with pytest.raises(InvalidRequestError, match="already committed"):
                await reservation.commit(make_tokens(8))
        assert cache.controller.device.used_pages == 2
        await cache.wait_idle()
        assert_consistent(cache)
