"""Sliding-window layers kept only where a continuation can need them (``tiers/storage/layer_split.py``).

A model of 6 layers, 5 sliding over 24 tokens and 1 full, on 4-token pages: a storage tier keeps
every page's full layer and the sliding layers of the last ``window_pages`` pages of what it wrote,
so a long prompt costs about a quarter of its whole pages. A hit from storage is exact at the end
of a stored prompt, and no hit ends where a window's sliding layers are missing (a prefix that
branches off inside a stored prompt, a sliding part deleted or flipped): shorter, never wrong.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCache, HiCacheConfig
from hicache.layer_kinds import restorable_end
from hicache.tiers.storage.layer_split import LayerSplitTier

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage

WINDOW = 24
LAYERS = [f"sliding:{WINDOW}"] * 5 + ["full"]
PAGE = 4
WINDOW_PAGES = 7  # ceil(23 / 4) + 1: one page of slack for an engine that recomputes a prompt's last page
# No window slack (the pages before a prefix end's window, kept for a branch a little before it)
# but where a test asks for it: every count below is the window's.
POLICIES = {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE, "window_slack_tokens": 0}


def hybrid_config(folder: Path, layout: str = "page_first", **storage: Any) -> HiCacheConfig:
    return make_config(
        device_pages=256, host_pages=256,
        model={"num_layers": 6, "layers": LAYERS},
        tiers={"host": {"layout": layout}, "storage": [{"kind": "file", "path": str(folder)} | storage]},
        policies=POLICIES,
    )


def stored_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.kv"))


async def retrieved_kv(cache: HiCache, tokens: list[int]) -> tuple[int, torch.Tensor]:
    """The hit and its KV ``[C, L, T, H, D]``."""
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        layers = [torch.stack(view.layer(layer)) for layer in range(cache.config.model.num_layers)]
        return view.tokens, torch.stack(layers, dim=1)


def test_the_rule_ends_a_hit_where_no_thin_page_is_in_its_window() -> None:
    assert restorable_end(100, [(0, 93)], 7) == 100
    assert restorable_end(100, [(0, 94)], 7) == 0  # every earlier end has a thin page in its window
    assert restorable_end(100, [(0, 40), (95, 96)], 7) == 95  # ends right before the thin page
    assert restorable_end(50, [(0, 40)], 7) == 50 and restorable_end(46, [(0, 40)], 7) == 0
    assert restorable_end(100, [(0, 100)], 0) == 100  # no sliding layer: every end is a hit
    assert restorable_end(5, [], 7) == 5


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
async def test_a_long_prompt_costs_a_quarter_of_its_whole_pages_and_comes_back_exact(
    tmp_path: Path, layout: str
) -> None:
    config = hybrid_config(tmp_path / "split", layout)
    assert config.model.layers.window_pages(PAGE) == WINDOW_PAGES
    tokens, kv = make_tokens(1024, seed=1), make_kv(config, 1024, seed=1)
    async with HiCache.from_config(config) as cache:
        assert isinstance(cache.controller.storage[0], LayerSplitTier)
        await cache.store(tokens, kv)
        await cache.wait_idle()
        split_moved = cache.stats().bytes_moved["host_to_storage"]
    whole = hybrid_config(tmp_path / "whole", split_layers=False)
    async with HiCache.from_config(whole) as cache:
        assert not isinstance(cache.controller.storage[0], LayerSplitTier)
        await cache.store(tokens, kv)
        await cache.wait_idle()
        whole_moved = cache.stats().bytes_moved["host_to_storage"]
    pages = 1024 // PAGE
    layer = config.page_bytes // 6
    # What the cache says it moved is the KV it wrote, headers aside.
    assert whole_moved == pages * 6 * layer and split_moved == pages * layer + WINDOW_PAGES * 5 * layer
    # 1 of 6 layers for 256 pages, 5 of 6 for the window's 7, and a 128-byte header per part
    assert stored_bytes(tmp_path / "whole") == pages * (6 * layer + 128)
    assert stored_bytes(tmp_path / "split") == pages * (layer + 128) + WINDOW_PAGES * (5 * layer + 128)
    thin = pages - WINDOW_PAGES
    async with HiCache.from_config(config) as cache:  # a fresh cache: only the folder is left
        hit = await cache.lookup(tokens + [7])
        assert hit.tokens == hit.by_tier["file"] == 1024
        got, restored = await retrieved_kv(cache, tokens + [7])
        assert got == 1024
        full, sliding = [5], [0, 1, 2, 3, 4]
        assert torch.equal(restored[:, full], kv[:, full])
        window = thin * PAGE
        assert torch.equal(restored[:, sliding, window:], kv[:, sliding, window:])
        assert not restored[:, sliding, :window].any()  # thin pages: zeros, never stale KV
        nodes = list(cache.controller.tree.nodes())
        assert sum(n.thin for n in nodes) == thin
        assert_consistent(cache)


async def test_a_prefix_branching_inside_a_stored_prompt_is_no_hit_until_its_own_pages_are_stored(
    tmp_path: Path,
) -> None:
    config = hybrid_config(tmp_path / "pages")
    tokens, kv = make_tokens(400, seed=2), make_kv(config, 400, seed=2)
    branch = tokens[:200] + make_tokens(100, seed=3)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert (await cache.lookup(branch)).tokens == 200  # in memory, every layer is whole
    async with HiCache.from_config(config) as cache:
        probe = await cache.lookup(branch, prefetch=False)
        assert probe.tokens == 0, probe  # pages 0-49 hold no sliding layers in the file tier
        got, _ = await retrieved_kv(cache, branch)
        assert got == 0
        assert (await cache.lookup(tokens)).tokens == 400  # the stored prompt's end still is a hit
        got, _ = await retrieved_kv(cache, tokens)
        assert got == 400
        assert (await cache.lookup(branch)).tokens == 0  # read back thin: not even from memory
        assert_consistent(cache)
    async with HiCache.from_config(config) as cache:  # the branch computed and stored: its own end is a hit
        await cache.store(branch, make_kv(config, 300, seed=4))
        await push_to_storage(cache)
        assert (await cache.lookup(branch)).tokens == 300


@pytest.mark.parametrize("damage", ["delete", "flip"])
async def test_a_missing_or_flipped_sliding_part_shortens_the_hit(tmp_path: Path, damage: str) -> None:
    config = hybrid_config(tmp_path / "pages")
    tokens, kv = make_tokens(200, seed=5), make_kv(config, 200, seed=5)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    files = list((tmp_path / "pages").rglob("*.kv"))
    sizes = sorted({f.stat().st_size for f in files})
    sliding_parts = [f for f in files if f.stat().st_size == sizes[1]]
    assert len(files) == 200 // PAGE + WINDOW_PAGES and len(sliding_parts) == WINDOW_PAGES
    victim = sliding_parts[0]
    if damage == "delete":
        victim.unlink()
    else:
        raw = bytearray(victim.read_bytes())
        raw[-1] ^= 1
        victim.write_bytes(bytes(raw))
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, tokens)
        assert got < 200 // PAGE * PAGE
        assert torch.equal(restored[:, 5], kv[:, 5, :got])  # what it serves is exact
        if damage == "flip":
            assert cache.stats().storage["file"].backend.corrupt_pages == 1
        assert_consistent(cache)


async def test_a_tenant_key_and_a_codec_chain_seal_each_part(tmp_path: Path) -> None:
    config = hybrid_config(tmp_path / "pages", codec=["lossless"])
    config = make_config(
        device_pages=256, host_pages=256, tenant_key="k" * 32, model={"num_layers": 6, "layers": LAYERS},
        tiers={"storage": [{"kind": "file", "path": str(tmp_path / "pages"), "codec": ["lossless"]}]},
        policies=POLICIES,
    )
    tokens, kv = make_tokens(160, seed=6), make_kv(config, 160, seed=6)
    async with HiCache.from_config(config) as cache:
        assert isinstance(cache.controller.storage[0], LayerSplitTier)
        await cache.store(tokens, kv)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, tokens)
        assert got == 160
        assert torch.equal(restored[:, 5], kv[:, 5])
        assert torch.equal(restored[:, :5, -WINDOW:], kv[:, :5, -WINDOW:])
    other = make_config(
        device_pages=256, host_pages=256, tenant_key="j" * 32, model={"num_layers": 6, "layers": LAYERS},
        tiers={"storage": [{"kind": "file", "path": str(tmp_path / "pages"), "codec": ["lossless"]}]},
    )
    async with HiCache.from_config(other) as cache:  # another tenant finds nothing under its names
        assert (await cache.lookup(tokens)).tokens == 0


async def test_inspect_knows_both_parts_and_finds_a_flipped_sliding_part(tmp_path: Path) -> None:
    from hicache.containers import inspection_target
    from hicache.inspect import purge, summarize, verify

    config = hybrid_config(tmp_path / "pages")
    tokens = make_tokens(120, seed=7)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, make_kv(config, 120, seed=7))
        await cache.wait_idle()
    files = list((tmp_path / "pages").rglob("*.kv"))
    sliding_parts = sorted(f for f in files if f.stat().st_size == max(g.stat().st_size for g in files))
    raw = bytearray(sliding_parts[0].read_bytes())
    raw[-3] ^= 4
    sliding_parts[0].write_bytes(bytes(raw))
    _, backend, codec = inspection_target(config)
    assert isinstance(codec, tuple) and [c.part for c in codec] == ["layers:full", "layers:sliding"]
    async with backend:
        summary = await summarize(backend, codec, config, "file", quiet=True)
        labels = {g.label: g.pages for g in summary.groups}
        assert labels == {"this config (test-model), full layers": 30, "this config (test-model), sliding layers": 7}
        report = await verify(backend, codec, "file", quiet=True)
        assert report.ok == report.ours == 36 and [c.reason for c in report.corrupt] == ["checksum"]
        assert (await purge(backend, codec, "file", namespace="this", quiet=True)).selected == 37


async def test_a_store_placed_on_two_tiers_keeps_one_window(tmp_path: Path) -> None:
    """A device too small for the prompt: the store puts its head on the device and its tail on the
    host, as two nodes, and only the end of the second is a prefix end (one window, not two)."""
    config = make_config(
        device_pages=100, host_pages=256, model={"num_layers": 6, "layers": LAYERS},
        tiers={"storage": [{"kind": "file", "path": str(tmp_path / "pages")}]}, policies=POLICIES,
    )
    tokens, kv = make_tokens(1024, seed=8), make_kv(config, 1024, seed=8)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        assert len(list(cache.controller.tree.nodes())) == 2
        await cache.wait_idle()
    layer = config.page_bytes // 6
    assert stored_bytes(tmp_path / "pages") == 256 * (layer + 128) + WINDOW_PAGES * (5 * layer + 128)


def sliding_part_count(folder: Path) -> int:
    """Sliding parts in ``folder``: the larger of the two sizes (5 layers against 1)."""
    sizes = [f.stat().st_size for f in folder.rglob("*.kv")]
    return sizes.count(max(sizes))


async def test_questions_on_a_stored_document_make_its_end_a_hit_from_storage(tmp_path: Path) -> None:
    """Questions on one document: the first stored document + question, so the tier kept the
    window before the question's end; the document's end becomes a hit end when a second question
    branches off there, whether this process still indexes the document or not (a fresh one only
    sees the tier's full parts end there), and only the two missing pages are written."""
    config = hybrid_config(tmp_path / "pages")
    doc = make_tokens(200, seed=20)
    asks = [doc + make_tokens(8, seed=21 + q) for q in range(4)]
    kvs = [make_kv(config, 208, seed=30 + q) for q in range(4)]
    for kv in kvs[1:]:
        kv[:, :, :200] = kvs[0][:, :, :200]  # the document's KV is the same under every question
    async with HiCache.from_config(config) as cache:
        await cache.store(asks[0], kvs[0])
        await cache.wait_idle()
    assert sliding_part_count(tmp_path / "pages") == WINDOW_PAGES  # pages 45-51: not doc's 43-44
    async with HiCache.from_config(config) as cache:  # a fresh process: the tier's full parts end at 50
        assert (await cache.lookup(asks[1], prefetch=False)).tokens == 0
        await cache.store(asks[1], kvs[1])
        await cache.wait_idle()
    # The document's missing window pages (43-44) and question 1's own two pages.
    assert sliding_part_count(tmp_path / "pages") == WINDOW_PAGES + 2 + 2
    async with HiCache.from_config(config) as cache:
        assert (await cache.lookup(asks[2], prefetch=False)).tokens == 200
        got, restored = await retrieved_kv(cache, asks[2])
        assert got == 200
        assert torch.equal(restored[:, 5], kvs[0][:, 5, :200])
        assert torch.equal(restored[:, :5, 200 - WINDOW:], kvs[0][:, :5, 200 - WINDOW:200])
        assert_consistent(cache)


async def test_a_question_branching_off_an_indexed_document_writes_the_documents_window(tmp_path: Path) -> None:
    """The same in one process: the second question splits the indexed document at its end, a
    branch point whose window the first question's store did not write whole."""
    config = hybrid_config(tmp_path / "pages")
    doc = make_tokens(200, seed=40)
    asks = [doc + make_tokens(8, seed=41 + q) for q in range(3)]
    kv = make_kv(config, 208, seed=44)
    async with HiCache.from_config(config) as cache:
        await cache.store(asks[0], kv)
        await cache.wait_idle()
        await cache.store(asks[1], kv)
        await cache.wait_idle()
    assert sliding_part_count(tmp_path / "pages") == WINDOW_PAGES + 2 + 2
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, asks[2])
        assert got == 200
        assert torch.equal(restored[:, :5, 200 - WINDOW:], kv[:, :5, 200 - WINDOW:200])


async def stored_prompt_and_a_branch(config: HiCacheConfig, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """A 400-token prompt stored to the file tier, and a prompt branching off it at token 200
    (page 50) with its KV: the prompt's up to there, then 8 tokens of its own."""
    tokens, kv = make_tokens(400, seed=seed), make_kv(config, 400, seed=seed)
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    branch = tokens[:200] + make_tokens(8, seed=seed + 1)
    return tokens, branch, torch.cat([kv[:, :, :200], make_kv(config, 8, seed=seed + 2)], dim=2)


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("given_from", [0, 200])
async def test_a_branch_off_pages_held_thin_is_a_hit_only_where_its_kv_was_given(
    tmp_path: Path, given_from: int, layout: str
) -> None:
    """A prompt read back thin (its sliding layers zeros in memory before the window), then a
    prompt that branches off inside it stored. Given the KV of the whole branch, the store fills
    the thin pages in the window before the branch point: a hit in memory at once, and storage
    is written that window (a fresh process hits it, exact). Given only the KV after the branch
    point (``start``), nothing can be filled, and the thin pages' zeros are never written as
    sliding parts: a fresh process finds no hit rather than zeros served as KV."""
    config = hybrid_config(tmp_path / "pages", layout)
    tokens, branch, branch_kv = await stored_prompt_and_a_branch(config, seed=50)
    async with HiCache.from_config(config) as cache:
        got, _ = await retrieved_kv(cache, tokens)  # pages 0-92 come back thin
        assert got == 400
        await cache.store(branch, branch_kv[:, :, given_from:], start=given_from)  # only 50-51 are new
        in_memory = (await cache.lookup(branch, prefetch=False)).tokens
        assert in_memory == (208 if given_from == 0 else 0)
        await cache.wait_idle()
        assert_consistent(cache)
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, branch)
        assert got == (208 if given_from == 0 else 0)
        assert torch.equal(restored[:, 5], branch_kv[:, 5, :got])
        start = max(0, got - WINDOW)
        assert torch.equal(restored[:, :5, start:got], branch_kv[:, :5, start:got])


@pytest.mark.parametrize("tier", ["host", "device"])
async def test_pages_an_engine_wrote_in_place_fill_the_thin_pages_they_duplicate(tmp_path: Path, tier: str) -> None:
    """The commit path (an engine that writes KV into reserved pages, as the vLLM connector
    does): a prompt branching off inside a prefix read back thin is written whole; the pages the
    index holds already are freed as duplicates, after their sliding layers filled the thin ones
    in the window before the branch point. A hit at once, and a fresh process hits it exact."""
    from .test_hold import write_pages

    config = hybrid_config(tmp_path / "pages")
    tokens, branch, branch_kv = await stored_prompt_and_a_branch(config, seed=70)
    async with HiCache.from_config(config) as cache:
        got, _ = await retrieved_kv(cache, tokens)  # pages 0-92 come back thin
        assert got == 400
        assert (await cache.lookup(branch, prefetch=False)).tokens == 0
        async with cache.reserve(52, tier=tier) as res:
            write_pages(res.tier, res.pages, branch_kv, 0, PAGE)
            assert await res.commit(branch) == 2 * PAGE  # pages 0-49 were cached: 50-51 are new
        assert (await cache.lookup(branch, prefetch=False)).tokens == 208
        await cache.wait_idle()
        assert_consistent(cache)
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, branch)
        assert got == 208
        assert torch.equal(restored[:, 5], branch_kv[:, 5])
        assert torch.equal(restored[:, :5, 208 - WINDOW :], branch_kv[:, :5, 208 - WINDOW :])


async def test_window_slack_makes_a_branch_just_before_a_stored_end_a_hit_at_once(tmp_path: Path) -> None:
    """``policies.window_slack_tokens``: the sliding layers of that many tokens more before each
    end, so the second question on a stored document is a hit at the document's end already."""
    config = make_config(
        device_pages=256, host_pages=256, model={"num_layers": 6, "layers": LAYERS},
        tiers={"storage": [{"kind": "file", "path": str(tmp_path / "pages")}]},
        policies=POLICIES | {"window_slack_tokens": 2 * PAGE - 1},  # two pages: a question's
    )
    doc = make_tokens(200, seed=60)
    kv = make_kv(config, 208, seed=60)
    async with HiCache.from_config(config) as cache:
        await cache.store(doc + make_tokens(8, seed=61), kv)
        await cache.wait_idle()
    assert sliding_part_count(tmp_path / "pages") == WINDOW_PAGES + 2
    async with HiCache.from_config(config) as cache:
        got, restored = await retrieved_kv(cache, doc + make_tokens(8, seed=62))
        assert got == 200
        assert torch.equal(restored[:, :5, 200 - WINDOW:], kv[:, :5, 200 - WINDOW:200])
        assert torch.equal(restored[:, 5], kv[:, 5, :200])
