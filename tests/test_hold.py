"""``HiCache.hold`` and host reservations: an engine that copies KV itself reads and writes pages in place.

The vLLM connector's path: a step's new pages are reserved on the host tier (``reserve(n,
tier="host")``), written there and committed; a later request's prefix is held where it lies
(``hold(tokens, start=...)``), only the pages after what the engine holds already, and read
straight from the tier's pages, with no device room needed.
"""

from __future__ import annotations

import pytest
import torch

from hicache import CapacityError, HiCache, InvalidRequestError

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage, resident_share


def write_pages(tier, pages: list[int], kv: torch.Tensor, first_token: int, page_size: int) -> None:
    """Write tokens ``first_token..`` of ``kv`` ``[C, L, T, H, D]`` into ``pages`` of ``tier``, layer by layer."""
    for layer in range(kv.shape[1]):
        view = tier.layer_view(layer)  # [pages, C, page_size * H * D]
        for i, page in enumerate(pages):
            chunk = kv[:, layer, first_token + i * page_size : first_token + (i + 1) * page_size]  # [C, ps, H, D]
            view[page] = chunk.reshape(chunk.shape[0], -1)


def read_held(held, kv_shape: torch.Size, page_size: int) -> torch.Tensor:
    """The held pages' KV as ``[C, L, tokens - start, H, D]``, read in place from their tiers."""
    c, layers, _, h, d = kv_shape
    out = []
    for layer in range(layers):
        parts = [tier.layer_view(layer)[torch.as_tensor(pages)] for tier, pages in held.segments]
        flat = torch.cat(parts)  # [pages, C, ps * H * D]
        out.append(flat.view(-1, c, page_size, h, d).permute(1, 0, 2, 3, 4).reshape(c, -1, h, d))
    return torch.stack(out, dim=1)


async def test_host_reservation_commit_then_hold_from_start_reads_the_pages_in_place() -> None:
    config = make_config(2, 32)  # a device tier of 2 pages: the prefix below is 8
    ps = config.page_size
    tokens, kv = make_tokens(8 * ps), make_kv(config, 8 * ps)
    async with HiCache.from_config(config) as cache:
        host = cache.controller.host
        async with cache.reserve(8, tier="host") as res:
            assert res.tier is host and host.used_pages == 8
            with pytest.raises(InvalidRequestError):
                res.slot_indices  # noqa: B018 - slot indices address the device pool
            write_pages(host, res.pages, kv, 0, ps)
            assert await res.commit(tokens) == 8 * ps
        await cache.wait_idle()
        assert cache.controller.device.used_pages == 0 and host.used_pages == 8
        # The engine holds the first 3 pages itself: only pages 3..7 are listed, and counted.
        async with cache.hold(tokens, start=3 * ps) as held:
            assert held.tokens == 8 * ps and held.start == 3 * ps and held.num_pages == 5
            assert all(tier is host for tier, _ in held.segments)
            assert dict(held.by_tier)["host"] == 5 * ps
            assert torch.equal(read_held(held, kv.shape, ps), kv[:, :, 3 * ps :])
            # Pinned: the host tier cannot evict it meanwhile.
            assert await cache.controller.evictor.evict_host(host.num_pages) <= 3
            assert host.used_pages >= 5
        stats = cache.stats()
        assert stats.short_retrieves == 0 and stats.tiers["device"].used_pages == 0  # nothing was staged
        assert stats.tiers["host"].hit_tokens == 5 * ps
        await cache.wait_idle()
        assert_consistent(cache)


async def test_hold_of_a_prefix_many_times_the_device_tier_is_never_cut_short() -> None:
    config = make_config(2, 64, tiers={"storage": [{"kind": "memory", "name": "mem"}]},
                         policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 0})
    ps = config.page_size
    tokens, kv = make_tokens(24 * ps, seed=3), make_kv(config, 24 * ps, seed=3)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)  # only storage holds it now
        async with cache.hold(tokens + [1, 2], start=4 * ps) as held:
            assert held.tokens == 24 * ps and held.num_pages == 20
            assert dict(held.by_tier)["mem"] == 20 * ps  # brought by the prefetch, counted by its tier
            assert torch.equal(read_held(held, kv.shape, ps), kv[:, :, 4 * ps :])
        async with cache.hold(tokens) as held:  # from start 0: the pages first supplied now are the file's
            assert held.num_pages == 24
            assert dict(held.by_tier)["host"] == 20 * ps and dict(held.by_tier)["mem"] == 4 * ps
        assert cache.stats().short_retrieves == 0
        await cache.wait_idle()
        assert_consistent(cache)


async def test_hold_past_the_cached_prefix_holds_nothing_and_bad_starts_raise() -> None:
    config = make_config(8, 16)
    ps = config.page_size
    tokens, kv = make_tokens(4 * ps), make_kv(config, 4 * ps)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens[: 2 * ps], kv[:, :, : 2 * ps])
        async with cache.hold(tokens, start=3 * ps) as held:
            assert held.tokens == 2 * ps and held.num_pages == 0 and held._pin is None
        async with cache.hold(tokens, start=ps) as held:  # wherever the store put it
            assert held.num_pages == 1
            assert torch.equal(read_held(held, kv.shape, ps), kv[:, :, ps : 2 * ps])
        for bad in (1, -ps, 5 * ps, True):
            with pytest.raises(InvalidRequestError):
                cache.hold(tokens, start=bad)
        with pytest.raises(InvalidRequestError):
            cache.reserve(1, tier="storage")
        with pytest.raises(CapacityError):
            cache.reserve(17, tier="host")
        await cache.wait_idle()
        assert_consistent(cache)


def _kernel_populates() -> bool:
    import ctypes
    import mmap

    region = mmap.mmap(-1, 1 << 20)
    view = ctypes.c_char.from_buffer(region)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    ok = libc.madvise(ctypes.addressof(view), 1 << 20, 23) == 0  # MADV_POPULATE_WRITE
    del view
    region.close()
    return ok


async def test_a_prefaulted_host_tier_is_resident_after_open_and_its_contents_are_untouched() -> None:
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("MADV_POPULATE_WRITE is Linux's")
    # 64 MiB: above glibc's largest dynamic mmap threshold, so each buffer is freshly mapped (not
    # resident) unless something in this process set the threshold higher (mallopt): then the
    # allocator may hand out memory another allocation touched, and residency proves nothing
    # about prefaulting (seen once in a full suite run); the contents check below still runs.
    plain = make_config(2, 32768)
    async with HiCache.from_config(plain) as cache:
        assert cache.controller.host.prefault_thread is None
        fresh = resident_share(cache.controller.host.buffer) < 0.5
    config = make_config(2, 32768, tiers={"host": {"prefault": True}})
    ps = config.page_size
    tokens, kv = make_tokens(8 * ps, seed=5), make_kv(config, 8 * ps, seed=5)
    async with HiCache.from_config(config) as cache:
        host = cache.controller.host
        assert host.prefault_thread is not None
        async with cache.reserve(8, tier="host") as res:  # written while the thread may still run
            write_pages(host, res.pages, kv, 0, ps)
            await res.commit(tokens)
        host.prefault_thread.join(timeout=60)
        if not _kernel_populates():
            pytest.skip("this kernel does not populate (MADV_POPULATE_WRITE, Linux 5.14+)")
        assert resident_share(host.buffer) > 0.99, "prefaulted" if fresh else "reused memory, yet not resident"
        async with cache.hold(tokens) as held:
            assert torch.equal(read_held(held, kv.shape, ps), kv)


async def test_a_recurrent_models_commit_places_its_checkpoint_pages_whole_and_a_hold_ends_on_one() -> None:
    """An engine that writes Mamba states into its reserved pages (the vLLM connector) names them
    at ``commit``: those pages are whole, the others thin, and a hold ends on a checkpoint."""
    config = make_config(2, 16, model={"num_layers": 2, "layers": ["recurrent:s=64/float32", "full"]})
    ps = config.page_size
    tokens = make_tokens(4 * ps, seed=5)
    async with HiCache.from_config(config) as cache:
        async with cache.reserve(4, tier="host") as res:
            for bad in ([3], [5 * ps], [0]):  # not a page end, past the pages, not after the first
                with pytest.raises(InvalidRequestError, match="checkpoint"):
                    await res.commit(tokens, checkpoints=bad)
            assert cache.controller.host.used_pages == 4  # still the reservation's
            assert await res.commit(tokens, checkpoints=[2 * ps, 4 * ps]) == 4 * ps
        async with cache.hold(tokens) as held:
            assert held.tokens == 4 * ps and held.thin == ((0, 1), (2, 3))
        async with cache.hold(tokens[: 3 * ps + 1]) as held:
            assert held.tokens == 2 * ps  # page 2 carries no state: the hit ends on the checkpoint before
        async with cache.reserve(2, tier="host") as res:  # no checkpoints: no hit can end on these
            other = make_tokens(2 * ps, seed=6)
            assert await res.commit(other) == 2 * ps
        async with cache.hold(other) as held:
            assert held.tokens == 0
        assert_consistent(cache)
