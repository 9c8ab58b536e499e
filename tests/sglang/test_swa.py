"""A sliding-window model through SGLang's real ``HybridCacheController`` (its v2 storage interface):
the ``kv`` and ``swa`` host pools backed up and restored by a fresh controller bit for bit; a deleted
or corrupt ``swa`` page shortens the hit and is never served; other namespaces and tenants see
nothing, and a ``swa`` page is never read as a KV page."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache.errors import UnsupportedModelError
from hicache.keys import external_page_keys

from .harness import LAYOUTS, HybridRig, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

W = HybridRig.window  # the window, in pages


@pytest.fixture
def rigs() -> Iterator[Callable[..., HybridRig]]:
    made: list[HybridRig] = []

    def make(path: Path, layout: str = "page_first", **kw: Any) -> HybridRig:
        overrides = kw.pop("overrides", {})
        rig = HybridRig({"interface_v1": 1, "storage": [{"kind": "file", "path": str(path)}], "overrides": overrides},
                        layout=layout, **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def written(rig: HybridRig, tokens: list[int], *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random KV pages for ``tokens`` and ``swa`` pages for its last window, backed up through SGLang."""
    kv, swa = rig.kv.alloc(len(tokens)), rig.swa.alloc(W * rig.swa.page_size)
    fill(rig.kv, kv, seed=seed)
    fill(rig.swa, swa, seed=seed + 1)
    assert rig.backup(kv, swa, tokens) == (len(tokens), W)
    return page_bytes(rig.kv, kv), page_bytes(rig.swa, swa)


def file_of(rig: HybridRig, root: Path, pool: str, page_hash: str) -> Path:
    """The file a page of ``pool`` (``kv`` or ``swa``) is stored in."""
    b = rig.storage
    chain = b._chain if pool == "kv" else b.pools[pool].chain
    name = chain.tiers[0].codec.storage_keys(external_page_keys(b.namespace.digest, [page_hash]))[0].hex()
    return root / name[:2] / f"{name}.kv"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_backup_then_a_fresh_controller_restores_kv_and_swa_bit_exact(
    rigs: Callable[..., HybridRig], tmp_path: Path, layout: str
) -> None:
    writer = rigs(tmp_path, layout)
    ps = writer.kv.page_size
    tokens = tokens_for(10, ps, seed=1)
    want_kv, want_swa = written(writer, tokens, seed=2)
    writer.close()

    reader = rigs(tmp_path, layout)  # another controller and backend: only the file tier is shared
    got = reader.prefetch(tokens)
    assert (got.hit, got.loaded, got.restorable) == (len(tokens), len(tokens), [10])
    assert got.swa_pages == W and got.swa_keys == page_hashes(tokens, ps)[-W:]
    assert torch.equal(page_bytes(reader.kv, got.kv_slots), want_kv)
    assert torch.equal(page_bytes(reader.swa, got.swa_slots), want_swa)
    assert reader.storage.pools["swa"].chain.stats().storage["file.swa"].fetched_pages == W

    # A prompt that ends inside the stored one has no window there: no hit (SGLang recomputes it).
    assert reader.prefetch(tokens[: 7 * ps]).hit == 0
    # One that goes on past it restores the stored prefix, its window included.
    more = reader.prefetch(tokens + tokens_for(4, ps, seed=3))
    assert (more.hit, more.loaded, more.swa_pages) == (len(tokens), len(tokens), W)
    assert torch.equal(page_bytes(reader.kv, more.kv_slots), want_kv)
    assert torch.equal(page_bytes(reader.swa, more.swa_slots), want_swa)
    assert reader.storage.failed_calls == 0


@pytest.mark.parametrize("damage", ["deleted", "flipped"])
def test_a_missing_or_corrupt_swa_page_shortens_the_hit(
    rigs: Callable[..., HybridRig], tmp_path: Path, damage: str
) -> None:
    """Two turns: 6 pages (window: pages 3-5), then 12 (window: pages 9-11). Page 10's ``swa`` part
    goes: the hit falls back to the first turn's end, whose window is whole, and is exact there."""
    writer = rigs(tmp_path)
    ps = writer.kv.page_size
    first = tokens_for(6, ps, seed=11)
    second = first + tokens_for(6, ps, seed=12)
    want_kv1, want_swa1 = written(writer, first, seed=13)
    _, want_swa2 = written(writer, second, seed=15)
    victim = file_of(writer, tmp_path, "swa", page_hashes(second, ps)[10])
    if damage == "deleted":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-100] ^= 0x40  # one bit of the payload
        victim.write_bytes(bytes(data))

    reader = rigs(tmp_path)
    if damage == "flipped":
        # Present as far as a lookup can tell: SGLang reads the KV pages, then the window, where page 10
        # fails verification. It is not counted as read (SGLang drops the whole prefetch), is dropped
        # from the tier and counted as corrupt.
        bad = reader.prefetch(second)
        assert (bad.hit, bad.loaded, bad.swa_pages) == (len(second), len(second), 1)
        assert bad.restorable == [6, 12]  # both turns' ends: every length SGLang may agree on
        assert torch.equal(page_bytes(reader.swa, bad.swa_slots[:ps]), want_swa2[: want_swa2.numel() // W])
        assert reader.storage.stats().storage["file"].backend.corrupt_pages == 1
        assert not victim.exists()
    got = reader.prefetch(second)
    assert (got.hit, got.loaded, got.restorable) == (len(first), len(first), [6])
    assert got.swa_pages == W and got.swa_keys == page_hashes(first, ps)[-W:]
    assert torch.equal(page_bytes(reader.kv, got.kv_slots), want_kv1)
    assert torch.equal(page_bytes(reader.swa, got.swa_slots), want_swa1)


def test_other_tenants_and_models_see_nothing_and_a_swa_page_is_never_kv(
    rigs: Callable[..., HybridRig], tmp_path: Path
) -> None:
    key_a = {"tenant_key": "key-of-tenant-a-0123456789"}
    writer = rigs(tmp_path, overrides=key_a)
    ps = writer.kv.page_size
    tokens = tokens_for(8, ps, seed=21)
    want_kv, want_swa = written(writer, tokens, seed=22)
    hashes = page_hashes(tokens, ps)
    kv_files = {file_of(writer, tmp_path, "kv", h) for h in hashes}
    swa_files = {file_of(writer, tmp_path, "swa", h) for h in hashes[-W:]}
    assert kv_files.isdisjoint(swa_files) and set(tmp_path.glob("*/*.kv")) == kv_files | swa_files
    assert all(t.codec.keyed for t in writer.storage.pools["swa"].chain.tiers)  # named and MACed by the key

    same = rigs(tmp_path, overrides=key_a).prefetch(tokens)  # the same tenant: all of it, exact
    assert (same.hit, same.swa_pages) == (len(tokens), W)
    other_tenant = rigs(tmp_path, overrides={"tenant_key": "key-of-tenant-b-0123456789"})
    assert other_tenant.prefetch(tokens).hit == 0
    assert other_tenant.storage.batch_exists(hashes) == 0
    assert rigs(tmp_path, model="other-model", overrides=key_a).prefetch(tokens).hit == 0

    # Page 7's sliding-window part in the place of its KV page (same size here: 3 layers each) is
    # caught by its header (another namespace), counted and dropped: the hit ends before it.
    kv7, swa7 = file_of(writer, tmp_path, "kv", hashes[7]), file_of(writer, tmp_path, "swa", hashes[7])
    assert kv7.stat().st_size == swa7.stat().st_size
    kv7.write_bytes(swa7.read_bytes())
    reader = rigs(tmp_path, overrides=key_a)
    got = reader.prefetch(tokens)
    assert got.hit == len(tokens) and got.loaded == 7 * ps  # KV read stops at the planted page
    assert torch.equal(page_bytes(reader.kv, got.kv_slots[: got.loaded]), want_kv[: want_kv.numel() * 7 // 8])
    assert got.swa_pages == 0  # SGLang reads the window only after every KV page landed
    assert reader.storage.stats().storage["file"].backend.corrupt_pages == 1 and not kv7.exists()


def test_a_swa_pool_laid_out_unlike_the_kv_pool_is_refused(tmp_path: Path) -> None:
    """``swa`` pages are keyed and laid out as the KV pages: a pool that differs fails the attach with
    the reason, and the tiers are closed (other pools, Mamba state and indexers: ``test_factory.py``)."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from .harness import backend

    _, kv = pools("page_first")
    _, swa = pools("layer_first")
    made = backend(kv, {"interface_v1": 1, "storage": [{"kind": "file", "path": str(tmp_path)}]})
    made.register_mem_host_pool_v2(kv, PoolName.KV)
    with pytest.raises(UnsupportedModelError, match="'swa': layout 'layer_first' differs"):
        made.register_mem_host_pool_v2(swa, PoolName.SWA)
    assert "closed" in repr(made) and made.pools == {}
