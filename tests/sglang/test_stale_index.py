"""``batch_set_v1`` says stored only for pages in files (issue 50, item 17), through SGLang's interface.

The file tier's index of the pages it holds went stale: after another process removed the files
(its eviction, ``hicache inspect purge``) or after the folder was unusable for a while and came back
empty, ``batch_set_v1`` of those pages returned ``[True, True, True]`` with no file written, and
``batch_get_v1`` then ``[False, False, False]``. Real SGLang host pools, our backend as SGLang's
factory builds it, real files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.cli import main as cli_main

from .harness import backend, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

PAGES = 3


def page_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("??/*.kv") if p.is_file())


def written(tmp_path: Path) -> tuple[Any, Any, list[str], Any, Path]:
    """A backend over a file tier holding three pages it wrote: ``(backend, host, keys, slots, root)``."""
    root = tmp_path / "pages"
    _, host = pools("page_first")
    b = backend(host, {"interface_v1": 1, "storage": [{"kind": "file", "path": str(root)}]})
    keys = page_hashes(tokens_for(PAGES, host.page_size, seed=5), host.page_size)
    slots = host.alloc(PAGES * host.page_size)
    fill(host, slots, seed=6)
    assert b.batch_set_v1(keys, slots) == [True] * PAGES
    assert len(page_files(root)) == PAGES
    return b, host, keys, slots, root


def reads_back(b: Any, host: Any, keys: list[str], slots: Any) -> bool:
    """``batch_get_v1`` into fresh slots gives every page, byte for byte."""
    want = page_bytes(host, slots)
    fresh = host.alloc(PAGES * host.page_size)
    try:
        return b.batch_get_v1(keys, fresh) == [True] * PAGES and bool((page_bytes(host, fresh) == want).all())
    finally:
        host.free(fresh)


def test_a_set_after_another_process_purged_the_files_writes_them(tmp_path: Path) -> None:
    b, host, keys, slots, root = written(tmp_path)
    try:
        config = tmp_path / "purge.yaml"  # another process: `hicache inspect purge --all --yes`
        config.write_text(json.dumps({
            "model": {"name": "m", "num_layers": 3, "num_kv_heads": 2, "head_dim": 32, "dtype": "bfloat16"},
            "page_size": host.page_size, "tiers": {"storage": [{"kind": "file", "path": str(root)}]},
        }))
        assert cli_main(["inspect", "purge", str(config), "--all", "--yes", "--quiet"]) == 0
        assert page_files(root) == []
        assert b.batch_set_v1(keys, slots) == [True] * PAGES
        assert len(page_files(root)) == PAGES  # "stored" means written
        assert reads_back(b, host, keys, slots)
    finally:
        b.close()


def test_a_set_after_the_folder_was_unusable_and_came_back_empty_writes_them(tmp_path: Path) -> None:
    b, host, keys, slots, root = written(tmp_path)
    try:
        root.rename(tmp_path / "gone")
        root.write_bytes(b"not a folder")  # an unmounted disk, a moved folder: cannot be opened
        fresh = host.alloc(PAGES * host.page_size)
        assert b.batch_get_v1(keys, fresh) == [False] * PAGES  # misses, no exception
        host.free(fresh)
        root.unlink()
        root.mkdir()  # back, empty
        assert b.batch_set_v1(keys, slots) == [True] * PAGES
        assert len(page_files(root)) == PAGES
        assert reads_back(b, host, keys, slots)
    finally:
        b.close()
