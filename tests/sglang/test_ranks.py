"""Rank rules under SGLang: ``tp_rank``/``tp_size``/``pp_rank``/``is_mla_model`` of ``HiCacheStorageConfig``
select the namespace. Backend instances as different ranks share one file tier without mixing heads,
MLA latents are written by rank 0 only and read by all, and a page written at one layout (TP size,
head slice, pipeline stage, page order, model, tenant) is never served at another."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from .harness import SMALL, Shape, backend, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

PAGES = 4


@pytest.fixture
def ranks() -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``make(layout, shape, extra, **rank)`` -> ``(backend, host_pool)``; all closed at the end."""
    made: list[Any] = []

    def make(layout: str = "page_first", shape: Shape = SMALL, extra: dict | None = None, **rank: Any):
        _, host = pools(layout, shape)
        b = backend(host, {"interface_v1": 1, **(extra or {})}, **rank)
        made.append(b)
        return b, host

    yield make
    for b in made:
        b.close()


def tier(path: Path, **more: Any) -> dict[str, Any]:
    return {"storage": [{"kind": "file", "path": str(path)}], **more}


def write(b: Any, host: Any, tokens: list[int], seed: int) -> torch.Tensor:
    slots = host.alloc(len(tokens))
    fill(host, slots, seed)
    assert b.batch_set_v1(page_hashes(tokens, host.page_size), slots) == [True] * PAGES
    return page_bytes(host, slots)


def read(b: Any, host: Any, tokens: list[int]) -> torch.Tensor | None:
    """The pages read back, or None unless every one was there and verified."""
    slots = host.alloc(len(tokens))
    try:
        ok = b.batch_get_v1(page_hashes(tokens, host.page_size), slots)
        return page_bytes(host, slots) if all(ok) else None
    finally:
        host.free(slots)


def files(path: Path) -> int:
    return sum(1 for _ in path.glob("*/*.kv"))


def test_two_tp_ranks_share_one_tier_without_mixing_heads(ranks: Callable, tmp_path: Path) -> None:
    """Same SGLang keys (they are identical on every rank), different heads: each rank reads its own."""
    tokens = tokens_for(PAGES, 8, seed=1)
    (r0, h0), (r1, h1) = (ranks(extra=tier(tmp_path), tp_rank=r, tp_size=2) for r in range(2))
    assert (r0.namespace.kv_head_range, r1.namespace.kv_head_range) == ((0, 2, 4), (2, 4, 4))
    mine0 = write(r0, h0, tokens, seed=10)
    assert r1.batch_exists(page_hashes(tokens, 8)) == 0  # rank 0's pages are not rank 1's
    mine1 = write(r1, h1, tokens, seed=11)
    assert files(tmp_path) == 2 * PAGES
    assert torch.equal(read(r0, h0, tokens), mine0) and torch.equal(read(r1, h1, tokens), mine1)
    assert not torch.equal(mine0, mine1)


def test_mla_latents_are_written_by_rank_0_and_read_by_every_rank(ranks: Callable, tmp_path: Path) -> None:
    mla = Shape(mla=True)
    tokens = tokens_for(PAGES, 8, seed=2)
    r1, h1 = ranks("page_first", mla, extra=tier(tmp_path), tp_rank=1, tp_size=2)
    r0, h0 = ranks("page_first", mla, extra=tier(tmp_path), tp_rank=0, tp_size=2)
    assert not r1.namespace.writes_storage and r0.namespace.writes_storage
    write(r1, h1, tokens, seed=20)  # SGLang skips backups on MLA ranks but 0; if asked, nothing is written
    assert files(tmp_path) == 0 and r1.stats().backups_skipped == PAGES
    latent = write(r0, h0, tokens, seed=21)
    assert files(tmp_path) == PAGES
    assert torch.equal(read(r1, h1, tokens), latent) and torch.equal(read(r0, h0, tokens), latent)
    # A single-rank engine of the same model reads them too: the latent has no rank.
    solo, hs = ranks("page_first", mla, extra=tier(tmp_path))
    assert torch.equal(read(solo, hs, tokens), latent)


def test_a_page_is_served_only_at_the_layout_it_was_written_at(ranks: Callable, tmp_path: Path) -> None:
    """A 2-KV-head model, one head a rank: TP 2 rank 0 (head 0 of 2, layers 0-2) writes. Whoever holds
    exactly that slice in the same byte order reads it, whatever its TP size; nobody else does."""
    one_head = Shape(heads=1)
    total = tier(tmp_path, overrides={"parallel": {"total_kv_heads": 2}})
    tokens = tokens_for(PAGES, 8, seed=3)
    writer, wh = ranks("page_first", one_head, extra=total, tp_rank=0, tp_size=2)
    want = write(writer, wh, tokens, seed=30)
    readers = {
        "TP 2 rank 0": ranks("page_first", one_head, extra=total, tp_rank=0, tp_size=2),
        "TP 4 rank 1 (replica of head 0)": ranks("page_first", one_head, extra=total, tp_rank=1, tp_size=4),
        "TP 2 rank 1 (head 1)": ranks("page_first", one_head, extra=total, tp_rank=1, tp_size=2),
        "TP 4 rank 2 (head 1)": ranks("page_first", one_head, extra=total, tp_rank=2, tp_size=4),
        "TP 4, total unstated (claims head 1 of 4)": ranks("page_first", one_head, extra=tier(tmp_path), tp_rank=1, tp_size=4),
        "PP stage 1 (layers 3-5)": ranks(
            "page_first", Shape(heads=1, start_layer=3), extra=total, tp_rank=0, tp_size=2, pp_rank=1, pp_size=2
        ),
        "token-major vs layer-major (layer_first pool)": ranks("layer_first", one_head, extra=total, tp_rank=0, tp_size=2),
        "another model": ranks("page_first", one_head, extra=total, tp_rank=0, tp_size=2, model="other-model"),
        "another tenant": ranks(
            "page_first", one_head, tp_rank=0, tp_size=2,
            extra=tier(tmp_path, overrides={"parallel": {"total_kv_heads": 2}, "tenant_key": "k" * 24}),
        ),
    }
    served = {name: read(b, h, tokens) for name, (b, h) in readers.items()}
    assert [name for name, got in served.items() if got is not None] == ["TP 2 rank 0", "TP 4 rank 1 (replica of head 0)"]
    assert all(torch.equal(served[name], want) for name in ("TP 2 rank 0", "TP 4 rank 1 (replica of head 0)"))
    # The replica does not write what its first replica writes.
    replica = readers["TP 4 rank 1 (replica of head 0)"][0]
    assert not replica.namespace.writes_storage


def test_a_tenant_key_keeps_tenants_apart_on_one_tier(ranks: Callable, tmp_path: Path) -> None:
    tokens = tokens_for(PAGES, 8, seed=4)
    key_a, key_b = "tenant-a-" + "x" * 16, "tenant-b-" + "y" * 16
    a, ha = ranks(extra=tier(tmp_path, overrides={"tenant_key": key_a}))
    want = write(a, ha, tokens, seed=40)
    a2, ha2 = ranks(extra=tier(tmp_path, overrides={"tenant_key": key_a}))
    b, hb = ranks(extra=tier(tmp_path, overrides={"tenant_key": key_b}))
    assert torch.equal(read(a2, ha2, tokens), want)
    assert b.batch_exists(page_hashes(tokens, 8)) == 0 and read(b, hb, tokens) is None
    assert not any(p.stem in {k for k in page_hashes(tokens, 8)} for p in tmp_path.glob("*/*.kv"))  # names are keyed
