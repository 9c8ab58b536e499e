"""Sliding layers leave the host first (``tiers/shed.py``, ``Evictor.shed_host``).

A model of 6 layers, 5 sliding over 64 tokens and 1 full, on 16-token pages of 8 KiB per layer and
component: a compact host gives back the memory of a page's sliding layers (5/6 of it) wherever no
prefix end's window needs them, before it evicts any page. So a host of 16 whole pages holds a
40-page prompt, and the prompt's end is still an exact hit; a prefix ending inside the shed part is
a shorter hit, never other KV.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.tiers.base import KVGeometry
from hicache.tiers.host import HostPool

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, resident_share

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_DONTNEED): Linux")

PAGE = 16
WINDOW = 64
WINDOW_PAGES = 5  # ceil(63 / 16) + 1
LAYERS = [f"sliding:{WINDOW}"] * 5 + ["full"]
MODEL = {"num_layers": 6, "layers": LAYERS, "num_kv_heads": 2, "head_dim": 64}


def shed_config(host_pages: int, *, compact: bool | str = "auto", device_pages: int = 8, **over: Any) -> HiCacheConfig:
    tiers = {"host": {"compact": compact}} | over.pop("tiers", {})
    return make_config(
        device_pages=device_pages, host_pages=host_pages, page_size=PAGE, model=MODEL, tiers=tiers,
        policies={"window_slack_tokens": 0} | over.pop("policies", {}), **over,
    )


async def retrieved(cache: HiCache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """The hit and its KV ``[C, L, T, H, D]``."""
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        layers = [torch.stack(view.layer(layer)) for layer in range(cache.config.model.num_layers)]
        return view.tokens, torch.stack(layers, dim=1)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_a_shed_page_keeps_its_full_layers_reads_zeros_in_its_sliding_ones_and_gives_memory_back(
    layout: str,
) -> None:
    g = KVGeometry(2, 6, PAGE, 2, 64, torch.float32)  # 8 KiB a layer and component
    host = HostPool(g, 32 * g.page_bytes, layout=layout, sliding_layers=(0, 1, 2, 3, 4))
    assert host.compact and host.capacity_pages == 32 and host.num_pages == 32 * 6
    async with host:
        pages = host.allocator.allocate(32)
        assert host.free_pages == 0
        data = torch.randn(32, 2, 6, g.page_elems)
        host.page_major()[pages] = data
        if layout == "page_first":
            assert resident_share(host.buffer[pages[0] : pages[-1] + 1]) == 1.0
        host.shed(pages[:24])
        if layout == "page_first":  # before anything reads them (a read maps the zero page)
            first = host.buffer[pages[0] : pages[23] + 1]
            assert resident_share(first) == pytest.approx(1 / 6, abs=0.01)
        view = host.page_major()
        assert torch.equal(view[pages[:24], :, 5], data[:24, :, 5]), "a full layer changed"
        assert not view[pages[:24], :, :5].any(), "a shed sliding layer holds KV"
        assert torch.equal(view[pages[24:]], data[24:]), "a page not shed changed"
        # 24 pages gave back 5/6 of their memory: 20 whole pages fit again, and the OS has it back.
        assert host.free_pages == 20 and host.shed_pages == 24
        assert host.allocator.shed_bytes == 24 * 5 * g.page_bytes // 6
        host.shed(pages[:24])  # again: nothing changes
        assert host.free_pages == 20
        more = host.allocator.allocate(20)
        assert host.free_pages == 0
        host.restore(pages[:2])  # written whole again: the budget is overdrawn, nothing fits
        assert host.free_pages == 0 and host.shed_pages == 22
        host.allocator.free(pages[:24] + more)
        assert host.free_pages == 24 and host.shed_pages == 0  # 8 whole pages are still held


def test_a_pool_that_cannot_give_memory_back_stays_whole() -> None:
    g = KVGeometry(2, 6, 4, 2, 8, torch.float32)  # 256 bytes a layer: no whole 4 KiB page to give back
    host = HostPool(g, 32 * g.page_bytes, sliding_layers=(0, 1, 2, 3, 4))
    assert not host.compact and host.num_pages == 32
    wide = KVGeometry(2, 6, PAGE, 2, 64, torch.float32)
    assert not HostPool(wide, 32 * wide.page_bytes, sliding_layers=(0, 1, 2, 3, 4), compact=False).compact
    assert not HostPool(wide, 32 * wide.page_bytes, sliding_layers=()).compact  # no sliding layer


DOCS, DOC_PAGES = 4, 16


async def store_documents(cache: HiCache, config: HiCacheConfig) -> list[tuple[list[int], torch.Tensor]]:
    docs = [(make_tokens(DOC_PAGES * PAGE, seed=10 + i), make_kv(config, DOC_PAGES * PAGE, seed=10 + i)) for i in range(DOCS)]
    for tokens, kv in docs:
        result = await cache.store(tokens, kv)
        assert result.stored_tokens == len(tokens)
        await cache.wait_idle()
    return docs


@pytest.mark.parametrize("compact", [True, False])
async def test_a_host_of_40_pages_holds_64_pages_of_documents_whose_ends_stay_exact_hits(compact: bool) -> None:
    config = shed_config(40, compact=compact, device_pages=20)
    async with HiCache.from_config(config) as cache:
        docs = await store_documents(cache, config)
        stats = cache.stats()
        hits = [(await retrieved(cache, tokens))[0] for tokens, _ in docs]
        if not compact:
            # The control: the same pressure evicts, and the first document is no longer a hit.
            assert stats.sliding_shed_pages == 0 and stats.tiers["host"].evicted_pages > 0 and hits[0] == 0
            return
        host = stats.tiers["host"]
        assert host.evicted_pages == 0 and stats.tiers["device"].evicted_pages > 0
        assert stats.sliding_shed_pages >= (DOC_PAGES - WINDOW_PAGES) * (DOCS - 1) and host.shed_pages == stats.sliding_shed_pages
        assert host.used_bytes <= host.capacity_bytes < host.used_pages * host.page_bytes
        assert hits == [DOC_PAGES * PAGE] * DOCS
        window = DOC_PAGES * PAGE - WINDOW_PAGES * PAGE
        for tokens, kv in docs:
            hit, got = await retrieved(cache, tokens)
            assert hit == len(tokens)
            assert torch.equal(got[:, 5], kv[:, 5]), "a full layer differs"
            assert torch.equal(got[:, :5, window:], kv[:, :5, window:]), "the window's sliding layers differ"
            assert bool(((got[:, :5, :window] == kv[:, :5, :window]) | (got[:, :5, :window] == 0)).all())
        # A prefix ending inside the shed part of the first document: its window is not whole
        # there, so the hit is shorter (here: none), never other KV.
        tokens, kv = docs[0]
        short, part = await retrieved(cache, tokens[: 7 * PAGE] + make_tokens(PAGE, seed=9))
        assert short < 7 * PAGE and torch.equal(part[:, 5], kv[:, 5, :short])
        assert_consistent(cache)


async def test_a_store_that_branches_inside_the_shed_part_fills_its_window_and_is_then_an_exact_hit() -> None:
    config = shed_config(40, device_pages=20)
    async with HiCache.from_config(config) as cache:
        docs = await store_documents(cache, config)
        assert cache.stats().sliding_shed_pages > 0
        tokens, kv = docs[0]
        branch = tokens[: 7 * PAGE] + make_tokens(4 * PAGE, seed=5)
        branch_kv = torch.cat([kv[:, :, : 7 * PAGE], make_kv(config, 4 * PAGE, seed=5)], dim=2)
        await cache.store(branch, branch_kv)  # given the KV again: the thin pages of its window are filled
        await cache.wait_idle()
        for end in (7 * PAGE, len(branch)):  # the branch point, and the branch's own end
            hit, got = await retrieved(cache, branch[:end] + make_tokens(PAGE, seed=6))
            assert hit == end
            window = end - WINDOW_PAGES * PAGE
            assert torch.equal(got[:, 5], branch_kv[:, 5, :end])
            assert torch.equal(got[:, :5, window:], branch_kv[:, :5, window:end])
            assert not got[:, :5, : 2 * PAGE].any(), "pages before the filled window stay thin"
        host = cache.stats().tiers["host"]
        assert host.used_bytes <= host.capacity_bytes or host.shed_pages  # overdrawn only until an eviction
        assert_consistent(cache)


async def test_pages_owed_to_a_whole_page_tier_keep_their_sliding_layers_until_written(tmp_path: Path) -> None:
    """Write-back to a tier that stores whole pages: shedding first would store zeros as KV. The
    pages are written whole (then evicted), and a fresh process reads exactly the KV stored."""
    storage = {"storage": [{"kind": "file", "path": str(tmp_path), "split_layers": False}]}
    config = shed_config(16, tiers=storage, policies={"write": "write_back", "prefetch": "wait_complete",
                                                      "prefetch_threshold_tokens": PAGE})
    tokens, kv = make_tokens(40 * PAGE, seed=7), make_kv(config, 40 * PAGE, seed=7)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().sliding_shed_pages == 0
    async with HiCache.from_config(config) as cache:
        hit, got = await retrieved(cache, tokens)
        assert hit > 0 and torch.equal(got, kv[:, :, :hit])


async def test_with_a_layer_split_tier_pages_read_back_thin_cost_only_their_full_layers(tmp_path: Path) -> None:
    storage = {"storage": [{"kind": "file", "path": str(tmp_path)}]}
    policies = {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE}
    config = shed_config(64, tiers=storage, policies=policies, device_pages=48)
    tokens, kv = make_tokens(40 * PAGE, seed=8), make_kv(config, 40 * PAGE, seed=8)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:  # a fresh process: only the folder is left
        assert (await cache.lookup(tokens + [7])).by_tier["file"] == len(tokens)
        hit, got = await retrieved(cache, tokens + [7])
        assert hit == len(tokens)
        host = cache.stats().tiers["host"]
        assert host.shed_pages == 40 - WINDOW_PAGES, "pages read back thin keep their sliding layers' memory"
        assert host.used_bytes == WINDOW_PAGES * host.page_bytes + (40 - WINDOW_PAGES) * host.page_bytes // 6
        window = len(tokens) - WINDOW_PAGES * PAGE
        assert torch.equal(got[:, 5], kv[:, 5]) and torch.equal(got[:, :5, window:], kv[:, :5, window:])
        assert_consistent(cache)


async def test_write_back_to_a_layer_split_tier_sheds_first_and_a_fresh_process_gets_every_end_exact(
    tmp_path: Path,
) -> None:
    """A layer-split tier keeps sliding layers in windows only: pages owed to it may shed outside
    them before they are written, and nothing it is promised is lost."""
    storage = {"storage": [{"kind": "file", "path": str(tmp_path)}]}
    policies = {"write": "write_back", "prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE}
    config = shed_config(40, tiers=storage, policies=policies, device_pages=20)
    async with HiCache.from_config(config) as cache:
        docs = await store_documents(cache, config)
        stats = cache.stats()
        # Three documents spilled to a host that holds 2.5 whole: one sheds, none is evicted or written.
        assert stats.sliding_shed_pages == DOC_PAGES - WINDOW_PAGES and stats.tiers["host"].evicted_pages == 0
        assert stats.lost_pages == 0
    async with HiCache.from_config(config) as cache:  # a fresh process: only the folder is left
        window = DOC_PAGES * PAGE - WINDOW_PAGES * PAGE
        for tokens, kv in docs:
            assert (await cache.lookup(tokens + [7])).tokens == len(tokens)
            hit, got = await retrieved(cache, tokens + [7])
            assert hit == len(tokens)
            assert torch.equal(got[:, 5], kv[:, 5]) and torch.equal(got[:, :5, window:], kv[:, :5, window:])
        assert_consistent(cache)


async def test_pages_read_back_thin_are_never_written_whole_to_a_tier_below(tmp_path: Path) -> None:
    """A page read thin from a layer-split tier has zeros for its sliding layers: a whole-page tier
    further down the chain must not store it (a later process would read zeros as KV)."""
    split = {"kind": "file", "name": "split", "path": str(tmp_path / "split")}
    whole = {"kind": "file", "name": "whole", "path": str(tmp_path / "whole"), "split_layers": False}
    policies = {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE}
    config = shed_config(64, tiers={"storage": [split]}, policies=policies, device_pages=48)
    tokens, kv = make_tokens(40 * PAGE, seed=9), make_kv(config, 40 * PAGE, seed=9)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    chain = shed_config(64, tiers={"storage": [split, whole]}, policies=policies, device_pages=48)
    async with HiCache.from_config(chain) as cache:  # reads the pages thin, writes through to `whole`
        hit, _ = await retrieved(cache, tokens + [7])
        assert hit == len(tokens)
        await cache.wait_idle()
    below = shed_config(64, tiers={"storage": [whole]}, policies=policies, device_pages=48)
    async with HiCache.from_config(below) as cache:
        hit, got = await retrieved(cache, tokens + [7])
        assert torch.equal(got, kv[:, :, :hit]), "a page stored whole with zeros for its sliding layers"
