"""Parallel engines, who writes: a rank whose shared pages another rank writes (an MLA latent on any
rank but 0, a replica of a KV head) reads shared storage and never writes it, and it is owed nothing
there: its host pages may always leave, none counts as lost, none waits for a write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from hicache import HiCache
from hicache.controller.residency import Residency, Verdict
from hicache.policies.write import WriteBack, WriteThrough
from hicache.radix_tree import HiRadixTree

from .conftest import make_config, make_kv, make_tokens
from .helpers import assert_consistent

MLA = {"attention": "mla", "num_kv_heads": 1}


def rank_config(tmp_path: Path, rank: int, *, tier: dict[str, Any] | None = None, host_pages: int = 64,
                write: str = "write_through", **extra: Any) -> Any:
    """Rank ``rank`` of an MLA model at TP 2 over one shared tier (rank 0 writes, rank 1 reads)."""
    storage = tier or {"kind": "file", "path": str(tmp_path / "pages")}
    return make_config(
        8, host_pages, model=MLA, parallel={"tp_rank": rank, "tp_size": 2},
        tiers={"storage": [storage]},
        policies={"write": write, "prefetch": "wait_complete", "prefetch_threshold_tokens": 4}, **extra,
    )


def test_the_residency_rule_owes_a_non_writer_nothing_below_the_host() -> None:
    tree = HiRadixTree(page_size=4, namespace_digest=b"\0" * 16)
    node = tree.extend(tree.root, bytes(4 * 8))
    node.host = [0]  # on the host, never written to storage
    tiers = ["a storage tier"]
    writer = Residency(WriteThrough(), storage=tiers)
    reader = Residency(WriteThrough(), storage=tiers, writes_storage=False)
    assert writer.leave_host(node) is Verdict.COPY and writer.owed_below(node)
    assert reader.leave_host(node) is Verdict.FREE and not reader.owed_below(node)
    assert reader.has_storage and not reader.owes_storage  # it still reads the tier
    node.store_failed = True  # (cannot happen to a reader; were it set, still nothing is lost)
    assert writer.leave_host(node) is Verdict.LOST and reader.leave_host(node) is Verdict.FREE
    # The host is still promised what the device holds: a reader's own memory tiers follow the policy.
    node.host, node.device = None, [0]
    assert Residency(WriteBack(), storage=tiers, writes_storage=False).leave_device(node) is Verdict.COPY


async def test_rank_0_writes_the_latent_rank_1_reads_it_and_writes_nothing(tmp_path: Path) -> None:
    configs = [rank_config(tmp_path, r) for r in range(2)]
    assert [c.model.attention for c in configs] == ["mla", "mla"]
    tokens = make_tokens(6 * configs[0].page_size)
    kv = make_kv(configs[0], len(tokens))
    async with HiCache.from_config(configs[0]) as rank0, HiCache.from_config(configs[1]) as rank1:
        assert rank0.namespace.writes_storage and not rank1.namespace.writes_storage
        assert rank0.namespace.digest == rank1.namespace.digest  # one latent, one set of pages
        # Rank 1 computes the same latent and stores it first: nothing of it reaches storage.
        await rank1.store(tokens, kv)
        await rank1.wait_idle()
        assert rank1.stats().storage_backups == 0 and rank1.stats().storage["file"].stored_pages == 0
        assert (await rank0.lookup(tokens, prefetch=False)).tokens == 0  # rank 0 finds nothing in storage
        await rank0.store(tokens, kv)
        await rank0.wait_idle()
        assert rank0.stats().storage_backups == 6
    # A fresh rank 1 (empty memory) is served what rank 0 wrote.
    async with HiCache.from_config(rank_config(tmp_path, 1)) as rank1:
        hit = await rank1.lookup(tokens)
        assert hit.tokens == len(tokens) and hit.by_tier["file"] == len(tokens)
        async with rank1.retrieve(tokens) as view:
            await view.wait_layer(configs[0].model.num_layers - 1)
            for layer in range(configs[0].model.num_layers):
                (latent,) = view.layer(layer)
                torch.testing.assert_close(latent, kv[0, layer], rtol=0, atol=0)
        assert rank1.stats().storage_backups == 0
        await rank1.wait_idle()
        assert_consistent(rank1)


async def test_a_replicated_kv_head_is_written_by_its_first_rank_only(tmp_path: Path) -> None:
    """TP 4 of a 2-KV-head model: ranks 0, 1 hold head 0 and ranks 2, 3 head 1; 0 and 2 write."""
    written = {}
    for rank in range(4):
        config = make_config(
            8, 64, model={"num_kv_heads": 1}, parallel={"tp_rank": rank, "tp_size": 4, "total_kv_heads": 2},
            tiers={"storage": [{"kind": "file", "path": str(tmp_path / f"rank{rank}")}]},
        )
        tokens = make_tokens(4 * config.page_size)
        async with HiCache.from_config(config) as cache:
            await cache.store(tokens, make_kv(config, len(tokens)))
            await cache.wait_idle()
            written[rank] = cache.stats().storage_backups
    assert written == {0: 4, 1: 0, 2: 4, 3: 0}


@pytest.mark.parametrize("write", ["write_through", "write_back"])
async def test_a_non_writer_host_never_waits_for_storage_and_loses_nothing(tmp_path: Path, write: str) -> None:
    """Over a tier whose every call hangs: the writer's host would fill with pages waiting for writes
    (under write-back every host eviction writes first); a non-writer's host pages simply leave."""
    stalling = {"kind": "tests.fakes:StallingStorageBackend", "timeout_s": 30}
    config = rank_config(tmp_path, 1, tier=stalling, host_pages=8, write=write, controller={"alloc_wait_s": 20})
    ps = config.page_size
    with anyio.fail_after(10):  # a rank that waited for the stalled tier would hang here
        async with HiCache.from_config(config) as cache:
            for i in range(6):  # 24 pages through 8 device and 8 host pages
                tokens = make_tokens(4 * ps, seed=i)
                await cache.store(tokens, make_kv(config, len(tokens), seed=i))
                await cache.wait_idle()
            stats = cache.stats()
            assert stats.evictions > 0 and stats.tiers["host"].evicted_pages > 0
            assert stats.storage_backups == 0 and stats.eviction_waits == 0
            assert stats.queue_depths["storage"] == 0 and stats.in_flight == 0
            assert_consistent(cache)
            # What is still in memory is served: the last prompt, from the device or host.
            assert (await cache.lookup(tokens, prefetch=False)).tokens == len(tokens)
        # Closing drains nothing (nothing is owed) and counts nothing lost.
        assert cache.stats().lost_pages == 0
