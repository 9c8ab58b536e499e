"""Storage tiers inside a real cache: write policies at the host -> storage boundary, layouts, restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache import HiCache, load_config

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent, push_to_storage


def file_tier(root: Path, **policies: object) -> dict:
    return {
        "tiers": {"storage": [{"kind": "file", "path": str(root)}]},
        "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 4, **policies},
    }


async def read_back(cache: HiCache, tokens: list[int], kv: torch.Tensor) -> int:
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        for layer in range(kv.shape[1]):
            k, v = view.layer(layer)
            assert torch.equal(k, kv[0, layer, : view.tokens]) and torch.equal(v, kv[1, layer, : view.tokens])
        return view.tokens


async def test_write_through_reaches_storage_and_skips_what_is_there(tmp_path: Path) -> None:
    config = make_config(8, 16, **file_tier(tmp_path))
    tokens = make_tokens(6 * config.page_size)
    kv = make_kv(config, len(tokens))
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        stats = cache.stats()
        assert stats.storage_backups == 6 and stats.storage["file"].stored_pages == 6
        assert all(nd.stored for nd in cache.controller.tree.nodes())
        assert stats.bytes_moved["host_to_storage"] == 6 * config.page_bytes
    async with HiCache.from_config(config) as cache:  # a second run stores the same prompt again
        await cache.store(tokens, kv)
        await cache.wait_idle()
        tier = cache.stats().storage["file"]
        assert tier.skipped_pages == 6 and tier.stored_pages == 0  # the tier had them: not rewritten


async def test_selective_write_through_waits_for_hits(tmp_path: Path) -> None:
    config = make_config(8, 16, **file_tier(tmp_path, write="write_through_selective", write_threshold=2))
    tokens = make_tokens(4 * config.page_size)
    kv = make_kv(config, len(tokens))
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
        assert cache.stats().storage_backups == 0
        for _ in range(2):
            assert await read_back(cache, tokens, kv) == len(tokens)
        await cache.wait_idle()
        assert cache.stats().storage_backups == 4  # hot now: host, then storage


async def test_write_back_spills_host_evictions_to_storage(tmp_path: Path) -> None:
    config = make_config(4, 6, **file_tier(tmp_path, write="write_back"))
    prompts = [make_tokens(3 * config.page_size, seed=s) for s in range(6)]
    kvs = [make_kv(config, len(p), seed=s) for s, p in enumerate(prompts)]
    async with HiCache.from_config(config) as cache:
        for tokens, kv in zip(prompts, kvs, strict=True):
            await cache.store(tokens, kv)
        await cache.wait_idle()
        stats = cache.stats()
        assert stats.storage_backups == stats.spills_to_storage > 0  # only evictions wrote to storage
        assert stats.tiers["host"].evicted_pages > 0
        assert_consistent(cache)
        await push_to_storage(cache)  # whatever is still in memory goes down too
        for tokens, kv in zip(prompts, kvs, strict=True):
            assert await read_back(cache, tokens, kv) == len(tokens)  # nothing was lost


@pytest.mark.parametrize(
    ("writer", "reader", "dtype"),
    [
        ("layer_first", "page_first", "float32"),
        ("page_first", "layer_first", "float32"),
        ("layer_first", "page_first", "bfloat16"),
    ],
)
async def test_pages_move_between_host_layouts(tmp_path: Path, writer: str, reader: str, dtype: str) -> None:
    tokens = make_tokens(5 * 4)
    base = {**file_tier(tmp_path), "model": {"dtype": dtype}}
    config_w = make_config(8, 16, **{**base, "tiers": {**base["tiers"], "host": {"layout": writer}}})
    config_r = make_config(8, 16, **{**base, "tiers": {**base["tiers"], "host": {"layout": reader}}})
    kv = make_kv(config_w, len(tokens))
    async with HiCache.from_config(config_w) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    async with HiCache.from_config(config_r) as cache:  # also a restart: a fresh index, same folder
        hit = await cache.lookup(tokens, prefetch=False)
        assert hit.by_tier["file"] == len(tokens)
        assert await read_back(cache, tokens, kv) == len(tokens)


async def test_several_storage_tiers_are_probed_in_order(tmp_path: Path) -> None:
    config = make_config(
        8, 16,
        tiers={"storage": [{"kind": "memory", "name": "near"}, {"kind": "file", "path": str(tmp_path), "name": "far"}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )
    tokens = make_tokens(6 * config.page_size)
    kv = make_kv(config, len(tokens))
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        near = cache.controller.storage[0].backend
        await near.clear()  # the near tier lost everything (a restart of an in-memory tier)
        hit = await cache.lookup(tokens, prefetch=False)
        assert dict(hit.by_tier) == {"device": 0, "host": 0, "near": 0, "far": len(tokens)}
        assert await read_back(cache, tokens, kv) == len(tokens)


async def test_yaml_from_the_issue_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "tiers:\n"
        "  storage:\n"
        "    - kind: file\n"
        "      path: ~/.cache/hicache/pages\n"
        "      capacity: 20GiB\n"
        "policies:\n"
        "  prefetch: timeout\n"
        "  prefetch_threshold_tokens: 256\n"
        "  prefetch_timeout: {base_s: 2.0, per_ki_token_s: 0.1, max_s: 30.0}\n"
    )
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" is this test's folder
    small = make_config(8, 16)
    config = load_config(path, overrides={"model": small.model.model_dump(), "page_size": 16}, env={})
    entry = config.tiers.storage[0]
    assert (entry.kind, entry.options) == ("file", {"path": "~/.cache/hicache/pages", "capacity": "20GiB"})
    assert config.policies.prefetch_timeout.max_s == 30.0
    tokens = make_tokens(20 * 16)  # 320 tokens: above the 256-token prefetch threshold
    kv = make_kv(config, len(tokens))
    async with HiCache.from_config(config) as cache:
        backend = cache.controller.storage[0].backend
        assert backend.root == tmp_path / ".cache" / "hicache" / "pages"
        assert backend.settings.capacity == 20 * 1024**3
        await cache.store(tokens, kv)
        await cache.wait_idle()
    assert len(list((tmp_path / ".cache" / "hicache" / "pages").rglob("*.kv"))) == 20
    async with HiCache.from_config(config) as cache:
        hit = await cache.lookup(tokens)
        assert hit.by_tier["file"] == len(tokens) and hit.prefetch is not None
        assert await read_back(cache, tokens, kv) == len(tokens)
