"""Parallel engines: the namespace records the slice of the model a rank holds (KV heads, layers), one rank
writes what several hold alike (an MLA latent, a replicated head), and a page written at one layout is
served at another only where the slice is the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache import HiCache, load_config
from hicache.containers import namespace_from_config, page_codec_from_config
from hicache.errors import ConfigError
from hicache.keys import Namespace, external_page_keys

from .conftest import make_config, make_kv, make_tokens


def ns(heads: int = 2, layers: int = 4, attention: str = "mha", **parallel: Any) -> Namespace:
    model = {"name": "m", "num_layers": layers, "num_kv_heads": heads, "head_dim": 8, "attention": attention}
    return namespace_from_config(load_config(overrides={"model": model, "parallel": parallel}, env={}))


def test_a_single_rank_keeps_the_digest_it_always_had() -> None:
    """Caches written before the parallel section existed stay readable: the whole model adds nothing."""
    plain = Namespace("m", "", "mha", 4, 2, 8, "float32", 64)
    assert ns().digest == plain.digest
    assert ns(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, total_kv_heads=2).digest == plain.digest
    assert ns().kv_head_range == (0, 2, 2) and ns().layer_range == (0, 4) and ns().writes_storage


def test_tensor_parallel_ranks_hold_disjoint_heads_and_never_share_pages() -> None:
    ranks = [ns(heads=2, tp_rank=r, tp_size=4) for r in range(4)]
    assert [r.kv_head_range for r in ranks] == [(0, 2, 8), (2, 4, 8), (4, 6, 8), (6, 8, 8)]
    assert len({r.digest for r in ranks}) == 4
    assert all(r.writes_storage for r in ranks)  # every rank writes its own heads


def test_a_cache_is_served_at_another_tp_size_only_where_the_head_slices_match() -> None:
    # 2 KV heads: at TP 2 each rank holds one; at TP 4 ranks 0,1 hold head 0 and ranks 2,3 head 1.
    tp2 = [ns(heads=1, tp_rank=r, tp_size=2, total_kv_heads=2) for r in range(2)]
    tp4 = [ns(heads=1, tp_rank=r, tp_size=4, total_kv_heads=2) for r in range(4)]
    assert [r.kv_head_range for r in tp4] == [(0, 1, 2), (0, 1, 2), (1, 2, 2), (1, 2, 2)]
    assert tp4[0].digest == tp4[1].digest == tp2[0].digest  # the same head: the same pages
    assert tp4[2].digest == tp4[3].digest == tp2[1].digest
    assert tp4[1].digest != tp2[1].digest  # rank 1 holds head 0 at TP 4, head 1 at TP 2
    # Of replicas, the first writes; all read.
    assert [r.writes_storage for r in tp4] == [True, False, True, False]
    # 8 heads: TP 2 holds 4 a rank, TP 4 holds 2: no slice matches, nothing is shared.
    assert {ns(heads=4, tp_rank=r, tp_size=2).digest for r in range(2)}.isdisjoint(
        {ns(heads=2, tp_rank=r, tp_size=4).digest for r in range(4)}
    )


def test_an_unstated_total_never_lets_a_replica_claim_another_head() -> None:
    """Without ``total_kv_heads`` a rank assumes no head is replicated (total = heads x tp_size). A TP 4
    engine of a 2-head model that does not say so claims head slices of 4: it shares nothing with a
    TP 2 engine (safe), where claiming rank 1 holds head 1 would have served it the wrong head."""
    tp2_rank1 = ns(heads=1, tp_rank=1, tp_size=2)
    tp4_rank1 = ns(heads=1, tp_rank=1, tp_size=4)
    assert tp2_rank1.kv_head_range == (1, 2, 2) and tp4_rank1.kv_head_range == (1, 2, 4)
    assert tp2_rank1.digest != tp4_rank1.digest


def test_mla_latents_are_one_namespace_on_every_rank_written_by_rank_0() -> None:
    ranks = [ns(heads=1, attention="mla", tp_rank=r, tp_size=8) for r in range(8)]
    assert len({r.digest for r in ranks}) == 1
    assert ranks[0].digest == ns(heads=1, attention="mla").digest  # as a single rank's
    assert [r.writes_storage for r in ranks] == [True] + [False] * 7
    assert all(r.kv_head_range is None for r in ranks)


def test_pipeline_stages_hold_layer_ranges() -> None:
    stages = [ns(layers=4, pp_rank=r, pp_size=3) for r in range(3)]
    assert [s.layer_range for s in stages] == [(0, 4), (4, 8), (8, 12)]
    assert len({s.digest for s in stages}) == 3
    # The same layers at another stage count (uneven stages, first_layer stated) are the same pages.
    assert ns(layers=4, pp_rank=1, pp_size=2, first_layer=8).digest == stages[2].digest
    assert ns(layers=4, pp_rank=1, pp_size=2, first_layer=4).digest == stages[1].digest
    # TP and PP together: both slices are in the namespace.
    both = {ns(heads=1, tp_rank=t, tp_size=2, pp_rank=p, pp_size=2).digest for t in range(2) for p in range(2)}
    assert len(both) == 4


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"parallel": {"tp_rank": 2, "tp_size": 2}}, "parallel.tp_rank"),
        ({"parallel": {"pp_rank": 1}}, "parallel.pp_rank"),
        ({"parallel": {"tp_size": 2, "total_kv_heads": 6}}, "parallel.total_kv_heads"),  # 3 a rank, holds 2
        ({"parallel": {"tp_size": 4, "total_kv_heads": 3}}, "parallel.total_kv_heads"),  # 4 ranks, 3 heads
        ({"parallel": {"tp_size": 0}}, "parallel.tp_size"),
    ],
)
def test_a_parallel_layout_that_cannot_be_is_a_config_error(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(overrides=overrides, env={})


def test_external_page_keys_are_namespaced() -> None:
    name = "ab" * 32  # an SGLang page hash
    a, b = ns(heads=1, tp_rank=0, tp_size=2), ns(heads=1, tp_rank=1, tp_size=2)
    assert external_page_keys(a.digest, [name]) == external_page_keys(a.digest, [name.encode()])
    assert external_page_keys(a.digest, [name]) != external_page_keys(b.digest, [name])
    assert len(external_page_keys(a.digest, [name])[0]) == 16


def test_page_codecs_of_two_ranks_refuse_each_others_pages() -> None:
    import numpy as np

    codecs = [page_codec_from_config(make_config(parallel={"tp_rank": r, "tp_size": 2})) for r in range(2)]
    payload = np.arange(codecs[0].payload_bytes, dtype=np.uint8)
    header = memoryview(bytearray(128))
    codecs[0].encode(b"k" * 16, [memoryview(payload)], header)
    assert codecs[0].check(b"k" * 16, header, [memoryview(payload)]) is None
    assert codecs[1].check(b"k" * 16, header, [memoryview(payload)]) == "namespace"


async def test_a_page_written_at_one_layout_is_never_served_at_another(tmp_path: Path) -> None:
    """Real caches over one file tier, a model of 2 KV heads, one a rank: only a cache holding the
    writer's slice (head 0 of 2, layers 0-3) gets its pages back, whatever its TP size."""
    storage = {
        "tiers": {"storage": [{"kind": "file", "path": str(tmp_path)}]},
        "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    }

    def config(**parallel: Any) -> Any:
        return make_config(8, 16, **storage, model={"num_kv_heads": 1}, parallel={"total_kv_heads": 2, **parallel})

    writer = config(tp_rank=0, tp_size=2)
    tokens = make_tokens(4 * writer.page_size)
    async with HiCache.from_config(writer) as cache:
        await cache.store(tokens, make_kv(writer, len(tokens)))
        await cache.wait_idle()
        assert cache.stats().storage["file"].stored_pages == 4
    readers = {
        "TP 2 rank 0 (the writer's slice)": config(tp_rank=0, tp_size=2),
        "TP 4 rank 1 (a replica of head 0)": config(tp_rank=1, tp_size=4),
        "TP 2 rank 1 (head 1)": config(tp_rank=1, tp_size=2),
        "TP 4 rank 2 (head 1)": config(tp_rank=2, tp_size=4),
        "PP stage 1 (layers 4-7)": config(tp_rank=0, tp_size=2, pp_rank=1, pp_size=2),
    }
    found = {}
    for name, reader in readers.items():
        async with HiCache.from_config(reader) as cache:
            found[name] = (await cache.lookup(tokens)).tokens
    assert list(found.values()) == [len(tokens), len(tokens), 0, 0, 0], found
