"""SGLang's ``clear`` (its ``/hicache/storage-backend/clear``, open to anyone who reaches SGLang's port
without ``--admin-api-key``) removes this rank's pages only: on one real folder and one real Valkey,
engines of other tenants (other tenant keys) and of other models keep every page, and still hit."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import ConfigError

from .harness import backend, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

PAGES = 6
# Two tenants (each with its own key) of one model, and an engine of another model without a key.
ENGINES = {
    "tenant-a": ({"tenant_key": "key-of-tenant-a-0123456789"}, "model-1"),
    "tenant-b": ({"tenant_key": "key-of-tenant-b-0123456789"}, "model-1"),
    "model-2": ({}, "model-2"),
}


def _tiers(tmp_path: Path, valkey: Any) -> dict[str, list[dict[str, Any]]]:
    prefix = f"sgl-clear-{uuid.uuid4().hex[:8]}"  # the Valkey server is the session's: keep apart
    return {
        "file": [{"kind": "file", "path": str(tmp_path / "pages")}],
        "valkey": [{"kind": "redis", "url": f"redis://127.0.0.1:{valkey.port}/0", "key_prefix": prefix}],
    }


def _engines(host: Any, storage: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        name: backend(host, {"interface_v1": 1, "storage": storage, "overrides": overrides, **extra}, model=model)
        for name, (overrides, model) in ENGINES.items()
    }


def _stored(tier: str, tmp_path: Path, storage: list[dict[str, Any]]) -> int:
    """Pages the tier holds, counted on the tier itself (files, or keys under the prefix)."""
    if tier == "file":
        return sum(1 for p in (tmp_path / "pages").rglob("*") if p.is_file() and p.suffix == ".kv")
    import redis

    client = redis.Redis.from_url(storage[0]["url"])
    try:
        return sum(1 for _ in client.scan_iter(match=f"{storage[0]['key_prefix']}:*"))
    finally:
        client.close()


@pytest.mark.parametrize("tier", ["file", "valkey"])
def test_one_engines_clear_leaves_every_other_tenants_and_models_pages(tier: str, tmp_path: Path, valkey: Any) -> None:
    storage = _tiers(tmp_path, valkey)[tier]
    _, host = pools("page_first")
    ps = host.page_size
    engines = _engines(host, storage)
    try:
        tokens = tokens_for(PAGES, ps, seed=11)  # the same prompt for all: the same SGLang hashes
        keys = page_hashes(tokens, ps)
        written = {}
        for i, (name, b) in enumerate(engines.items()):
            slots = host.alloc(PAGES * ps)
            fill(host, slots, seed=20 + i)
            assert b.batch_set_v1(keys, slots) == [True] * PAGES, name
            written[name] = page_bytes(host, slots)
            host.free(slots)
        assert _stored(tier, tmp_path, storage) == len(ENGINES) * PAGES

        engines["tenant-a"].clear()  # what SGLang's HTTP clear calls on this rank

        assert engines["tenant-a"].batch_exists(keys) == 0  # its own pages are gone
        assert _stored(tier, tmp_path, storage) == (len(ENGINES) - 1) * PAGES
        for name in ("tenant-b", "model-2"):  # the others' are all there, and still hits, bit for bit
            b = engines[name]
            assert b.batch_exists(keys) == PAGES, name
            back = host.alloc(PAGES * ps)
            assert b.batch_get_v1(keys, back) == [True] * PAGES, name
            assert torch.equal(page_bytes(host, back), written[name]), name
            host.free(back)
    finally:
        for b in engines.values():
            b.close()


def test_clear_all_is_asked_for_and_clear_off_removes_nothing(tmp_path: Path, valkey: Any) -> None:
    storage = _tiers(tmp_path, valkey)["file"]
    _, host = pools("page_first")
    ps = host.page_size
    tokens = tokens_for(PAGES, ps, seed=12)
    keys = page_hashes(tokens, ps)
    for scope, left in (("off", len(ENGINES) * PAGES), ("all", 0)):
        engines = _engines(host, storage, clear=scope)
        try:
            slots = host.alloc(PAGES * ps)
            fill(host, slots, seed=30)
            for b in engines.values():
                assert all(b.batch_set_v1(keys, slots))
            host.free(slots)
            engines["tenant-a"].clear()
            assert _stored("file", tmp_path, storage) == left, scope
        finally:
            for b in engines.values():
                b.close()


def test_a_rank_that_does_not_write_storage_clears_nothing(tmp_path: Path) -> None:
    """MLA ranks other than 0 read rank 0's pages: rank 0 clears them, never another rank."""
    from .harness import Shape

    storage = [{"kind": "file", "path": str(tmp_path / "pages")}]
    _, host = pools("page_first", Shape(mla=True))
    ps = host.page_size
    keys = page_hashes(tokens_for(PAGES, ps, seed=13), ps)
    writer = backend(host, {"interface_v1": 1, "storage": storage}, tp_rank=0, tp_size=2)
    reader = backend(host, {"interface_v1": 1, "storage": storage}, tp_rank=1, tp_size=2)
    try:
        slots = host.alloc(PAGES * ps)
        fill(host, slots, seed=31)
        assert all(writer.batch_set_v1(keys, slots))
        reader.clear()
        assert reader.batch_exists(keys) == PAGES
        writer.clear()
        assert reader.batch_exists(keys) == 0
    finally:
        writer.close()
        reader.close()


def test_an_unknown_clear_scope_is_a_config_error() -> None:
    from hicache.integrations.sglang.settings import backend_settings

    with pytest.raises(ConfigError, match="clear"):
        backend_settings({"clear": "everything"})
