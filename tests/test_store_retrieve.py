"""Store then retrieve is bit-exact, from the device and from the host, for every layout and io backend."""

from __future__ import annotations

import pytest
import torch

from hicache import HiCache, InvalidKVError, InvalidRequestError

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent


async def _read_all(view) -> list[tuple[torch.Tensor, ...]]:
    out = []
    for layer in range(view._num_layers):
        await view.wait_layer(layer)
        out.append(view.layer(layer))
    return out


def _assert_prefix_equal(layers: list[tuple[torch.Tensor, ...]], kv: torch.Tensor, n: int) -> None:
    for layer, parts in enumerate(layers):
        for c, part in enumerate(parts):
            assert torch.equal(part, kv[c, layer, :n]), f"layer {layer} component {c} differs"


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("io", ["kernel", "direct"])
async def test_store_retrieve_bit_exact_from_device(layout: str, io: str) -> None:
    config = make_config(16, 64, tiers={"host": {"layout": layout}}, io={"backend": io})
    tokens, kv = make_tokens(30), make_kv(config, 30)
    async with HiCache.from_config(config) as cache:
        result = await cache.store(tokens, kv)
        assert (result.stored_tokens, result.cached_tokens) == (28, 0)  # 7 full pages of 4
        hit = await cache.lookup(tokens)
        assert hit.tokens == 28 and dict(hit.by_tier) == {"device": 28, "host": 0}
        async with cache.retrieve(tokens) as view:
            assert view.tokens == 28 and view.by_tier["device"] == 28
            _assert_prefix_equal(await _read_all(view), kv, 28)
        await cache.wait_idle()
        assert_consistent(cache)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("io", ["kernel", "direct"])
@pytest.mark.parametrize("write", ["write_through", "write_back"])
async def test_bit_exact_after_device_overflow(layout: str, io: str, write: str) -> None:
    """Many sequences overflow the device; the early ones come back from the host, bit-exact."""
    config = make_config(8, 64, tiers={"host": {"layout": layout}}, io={"backend": io}, policies={"write": write})
    seqs = [(make_tokens(16, seed=s), make_kv(config, 16, seed=s)) for s in range(12)]  # 48 pages > 8
    async with HiCache.from_config(config) as cache:
        for tokens, kv in seqs:
            await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().tiers["device"].evicted_pages > 0
        hit = await cache.lookup(seqs[0][0])
        assert dict(hit.by_tier) == {"device": 0, "host": 16}
        for tokens, kv in seqs:
            async with cache.retrieve(tokens) as view:
                assert view.tokens == 16
                _assert_prefix_equal(await _read_all(view), kv, 16)
        stats = cache.stats()
        assert stats.tiers["host"].hit_tokens > 0 and stats.loads > 0
        await cache.wait_idle()
        assert_consistent(cache)


async def test_shared_prefix_is_stored_once_and_split() -> None:
    config = make_config(32, 64)
    base = make_tokens(16, seed=1)
    kv_a = make_kv(config, 24, seed=2)
    a = base + make_tokens(8, seed=3)
    b = base + make_tokens(8, seed=4)
    kv_b = kv_a.clone()
    kv_b[:, :, 16:] = make_kv(config, 8, seed=5)
    async with HiCache.from_config(config) as cache:
        assert (await cache.store(a, kv_a)).stored_tokens == 24
        result = await cache.store(b, kv_b)
        assert (result.stored_tokens, result.cached_tokens) == (8, 16)
        assert cache.controller.device.used_pages == 8  # 4 shared + 2 + 2
        for tokens, kv in ((a, kv_a), (b, kv_b)):
            async with cache.retrieve(tokens) as view:
                assert view.tokens == 24
                _assert_prefix_equal(await _read_all(view), kv, 24)
        # A query that diverges mid-node matches only the shared pages.
        hit = await cache.lookup(base + [7, 7, 7, 7])
        assert hit.tokens == 16
        await cache.wait_idle()
        assert_consistent(cache)


async def test_store_is_idempotent_and_partial_pages_are_not_cached() -> None:
    config = make_config(16, 32)
    tokens, kv = make_tokens(11), make_kv(config, 11)
    async with HiCache.from_config(config) as cache:
        assert (await cache.store(tokens, kv)).stored_tokens == 8
        again = await cache.store(tokens, kv)
        assert (again.stored_tokens, again.cached_tokens) == (0, 8)
        assert (await cache.lookup(tokens[:3])).tokens == 0
        assert (await cache.lookup(tokens[:7])).tokens == 4
        assert (await cache.lookup([])).tokens == 0


async def test_miss_returns_empty_view() -> None:
    config = make_config()
    async with HiCache.from_config(config) as cache:
        async with cache.retrieve(make_tokens(20)) as view:
            assert view.tokens == 0 and view.device_pages == []
            await view.wait_layer(0)  # nothing to wait for
        stats = cache.stats()
        assert stats.tiers["device"].miss_tokens == 20 and stats.tiers["host"].miss_tokens == 20


async def test_mla_geometry_round_trip() -> None:
    config = make_config(16, 32, model={"attention": "mla", "num_kv_heads": 1, "head_dim": 16})
    tokens, kv = make_tokens(12), make_kv(config, 12)
    assert kv.shape == (1, 4, 12, 1, 16)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        async with cache.retrieve(tokens) as view:
            layers = await _read_all(view)
            assert all(len(parts) == 1 for parts in layers)
            _assert_prefix_equal(layers, kv, 12)


async def test_store_larger_than_device_goes_to_host() -> None:
    """A prompt bigger than the device pool: the head on the device, the tail on the host."""
    config = make_config(4, 32)
    tokens, kv = make_tokens(40), make_kv(config, 40)  # 10 pages, device holds 4
    async with HiCache.from_config(config) as cache:
        result = await cache.store(tokens, kv)
        assert result.stored_tokens == 40 and result.dropped_tokens == 0
        await cache.wait_idle()
        hit = await cache.lookup(tokens)
        assert hit.tokens == 40 and hit.by_tier["host"] > 0
        async with cache.retrieve(tokens) as view:
            # The device cannot hold all 10 pages at once: the view holds what fits.
            assert 16 <= view.tokens <= 40
            _assert_prefix_equal(await _read_all(view), kv, view.tokens)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_stats_snapshot_is_frozen_and_counts_traffic() -> None:
    config = make_config(16, 32)
    tokens, kv = make_tokens(16), make_kv(config, 16)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        stats = cache.stats()
        page_bytes = config.page_bytes
        assert stats.stores == 1 and stats.stored_pages == 4
        assert stats.bytes_moved["user_to_device"] == 4 * page_bytes
        assert stats.bytes_moved["device_to_host"] == 4 * page_bytes  # write-through backup
        assert stats.backups == 4
        assert stats.tiers["device"].used_pages == 4 and stats.tiers["device"].capacity_pages == 16
        assert stats.tiers["device"].used_bytes == 4 * page_bytes
        assert dict(stats.queue_depths) == {"backup": 0, "load": 0, "storage": 0, "prefetch": 0}
        with pytest.raises(AttributeError):
            stats.stores = 5  # type: ignore[misc]
        with pytest.raises(TypeError):
            stats.bytes_moved["user_to_device"] = 0  # type: ignore[index]


async def test_store_from_start_takes_only_the_kv_after_the_cached_prefix() -> None:
    """An engine that restored a prefix passes only the KV it computed (``start=view.tokens``)."""
    config = make_config(16, 64)
    tokens, kv = make_tokens(30), make_kv(config, 30)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens[:12], kv[:, :, :12])
        result = await cache.store(tokens, kv[:, :, 12:], start=12)
        assert (result.stored_tokens, result.cached_tokens) == (16, 12)
        async with cache.retrieve(tokens) as view:
            _assert_prefix_equal(await _read_all(view), kv, 28)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_store_from_start_after_a_gap_stores_nothing() -> None:
    config = make_config(16, 64)
    tokens, kv = make_tokens(30), make_kv(config, 30)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens[:4], kv[:, :, :4])  # one page; pages 1-2 were never given
        result = await cache.store(tokens, kv[:, :, 12:], start=12)
        assert (result.stored_tokens, result.cached_tokens, result.dropped_tokens) == (0, 4, 16)
        assert (await cache.lookup(tokens)).tokens == 4
        assert cache.stats().dropped_pages == 4


@pytest.mark.parametrize("start", [-4, 3, 32, 2.0, True])
async def test_store_rejects_a_bad_start(start: object) -> None:
    config = make_config(16, 64)
    tokens, kv = make_tokens(30), make_kv(config, 30)
    async with HiCache.from_config(config) as cache:
        with pytest.raises(InvalidRequestError, match="start"):
            await cache.store(tokens, kv, start=start)  # type: ignore[arg-type]
        with pytest.raises(InvalidKVError, match="after start"):
            await cache.store(tokens, kv, start=8)  # kv must then hold 22 tokens, not 30
        assert cache.stats().stored_pages == 0


async def test_a_device_only_cache_has_no_host_tier() -> None:
    config = make_config(16, 0)
    assert config.tiers.host.capacity == 0
    async with HiCache.from_config(config) as cache:
        for seed in range(6):  # 24 pages into 16
            tokens = make_tokens(16, seed=seed)
            await cache.store(tokens, make_kv(config, 16, seed=seed))
        await cache.wait_idle()
        stats = cache.stats()
        assert stats.tiers["host"].capacity_pages == 0 and stats.tiers["host"].used_pages == 0
        device = stats.tiers["device"]
        assert device.evicted_pages >= 8 and device.used_pages + device.evicted_pages == 24  # dropped, not moved
        assert stats.backups == 0
        assert (await cache.lookup(make_tokens(16, seed=5))).tokens == 16
        assert (await cache.lookup(make_tokens(16, seed=0))).tokens == 0
        assert_consistent(cache)
