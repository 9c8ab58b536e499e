"""A store that says stored writes the pages (issue 50, item 17), through ``HiCache.store``.

The file tier keeps an index of the pages it holds, and a write skips the pages a tier says it
already holds. The index went stale: when another process removed the files (its eviction,
``hicache inspect purge``) or the folder was unusable for a while and came back empty, a store
skipped every page, wrote nothing, and the node was marked stored. Here both happen to a live
cache with real files, and the store must leave every page in a file that a fresh cache reads.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import torch

from hicache import HiCache
from hicache.cli import main as cli_main

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent

PAGES = 6


def file_config(root: Path):
    return make_config(
        8, 16, tiers={"storage": [{"kind": "file", "name": "file", "path": str(root), "fsync": "never"}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*.kv") if p.is_file())


async def fresh_read(config, tokens: list[int], kv: torch.Tensor) -> int:
    """Tokens a new cache (nothing in memory) serves from the tier, checked bit for bit."""
    async with HiCache.from_config(config) as cache:
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            for layer in range(kv.shape[1]):
                k, v = view.layer(layer)
                assert torch.equal(k, kv[0, layer, : view.tokens]) and torch.equal(v, kv[1, layer, : view.tokens])
            return view.tokens


async def stored_by_another_cache(config, tokens: list[int], kv: torch.Tensor, root: Path) -> None:
    async with HiCache.from_config(config) as cache:
        await cache.store(tokens, kv)
        await cache.wait_idle()
    assert len(page_files(root)) == PAGES


async def test_files_purged_by_another_process_are_written_again(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    root = tmp_path / "pages"
    config = file_config(root)
    tokens, kv = make_tokens(PAGES * config.page_size), make_kv(config, PAGES * config.page_size)
    await stored_by_another_cache(config, tokens, kv, root)
    async with HiCache.from_config(config) as cache:  # its tier indexes the six pages at open
        # Another process empties the folder: `hicache inspect purge --all --yes`, its own backend.
        yaml = tmp_path / "config.yaml"
        yaml.write_text(json.dumps(config.model_dump(mode="json")))
        args = ["inspect", "purge", str(yaml), "--all", "--yes", "--quiet"]
        assert await anyio.to_thread.run_sync(cli_main, args) == 0, capsys.readouterr()  # its own event loop
        assert page_files(root) == []
        await cache.store(tokens, kv)
        await cache.wait_idle()
        tier = cache.stats().storage["file"]
        assert tier.skipped_pages == 0 and tier.stored_pages == PAGES  # written, not skipped
        assert len(page_files(root)) == PAGES
        assert_consistent(cache)
    assert await fresh_read(config, tokens, kv) == len(tokens)


async def test_files_evicted_by_another_process_are_written_again(tmp_path: Path) -> None:
    """Half the pages removed (another process's LRU eviction): the store writes those, skips the rest."""
    root = tmp_path / "pages"
    config = file_config(root)
    tokens, kv = make_tokens(PAGES * config.page_size), make_kv(config, PAGES * config.page_size)
    await stored_by_another_cache(config, tokens, kv, root)
    async with HiCache.from_config(config) as cache:
        from hicache.keys import as_token_bytes, chain_keys

        keys = chain_keys(cache.namespace.digest, as_token_bytes(tokens), config.page_size)
        for key in keys[3:]:
            os.unlink(root / key.hex()[:2] / f"{key.hex()}.kv")
        await cache.store(tokens, kv)
        await cache.wait_idle()
        tier = cache.stats().storage["file"]
        assert tier.skipped_pages == 3 and tier.stored_pages == 3
        assert len(page_files(root)) == PAGES
    assert await fresh_read(config, tokens, kv) == len(tokens)


async def test_a_folder_unusable_for_a_while_then_back_empty(tmp_path: Path) -> None:
    """The folder cannot be opened (a file in its place: an unmounted disk, a moved folder), reads
    fail meanwhile, then it is back, empty: the next store writes every page."""
    root = tmp_path / "pages"
    config = file_config(root)
    tokens, kv = make_tokens(PAGES * config.page_size), make_kv(config, PAGES * config.page_size)
    await stored_by_another_cache(config, tokens, kv, root)
    async with HiCache.from_config(config) as cache:
        root.rename(tmp_path / "gone")
        root.write_bytes(b"not a folder")
        async with cache.retrieve(tokens) as view:  # nothing from the tier now, and no error
            await view.wait_all()
            assert view.tokens == 0
        root.unlink()
        root.mkdir()  # back, empty
        await cache.store(tokens, kv)
        await cache.wait_idle()
        tier = cache.stats().storage["file"]
        assert tier.skipped_pages == 0 and tier.stored_pages == PAGES
        assert len(page_files(root)) == PAGES
        assert_consistent(cache)
    assert await fresh_read(config, tokens, kv) == len(tokens)


async def test_a_write_into_an_unusable_folder_is_failed_not_stored(tmp_path: Path) -> None:
    """While the folder cannot be opened, the write fails and is counted: never a page called stored."""
    root = tmp_path / "pages"
    config = file_config(root)
    tokens, kv = make_tokens(PAGES * config.page_size), make_kv(config, PAGES * config.page_size)
    await stored_by_another_cache(config, tokens, kv, root)
    async with HiCache.from_config(config) as cache:
        root.rename(tmp_path / "gone")
        root.write_bytes(b"not a folder")
        await cache.store(tokens, kv)
        await cache.wait_idle()
        tier = cache.stats().storage["file"]
        assert tier.stored_pages == 0 and tier.failures >= 1
        nodes = list(cache.controller.tree.nodes())
        assert nodes and all(nd.store_failed and not nd.stored for nd in nodes)
        root.unlink()
        root.mkdir()
