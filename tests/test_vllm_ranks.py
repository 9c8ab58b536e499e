"""The vLLM connector under tensor parallelism, without vLLM: each rank's config and namespace as the
connector derives them from vLLM's parallel config, and the scheduler's agreement over every rank's
worker (real caches behind real sockets, one shared file tier). vLLM itself at TP > 1 is in
tests/vllm/test_vllm_tp.py."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from anyio.from_thread import start_blocking_portal

from hicache import UnsupportedModelError
from hicache.containers import namespace_from_config
from hicache.integrations.vllm.channel import socket_path
from hicache.integrations.vllm.ranks import RankChannels, agree_lookups
from hicache.integrations.vllm.service import CacheService
from hicache.integrations.vllm.settings import cache_config_for, worker_rank

from .conftest import make_kv, make_tokens


def vllm_config(model: str, *, tp: int = 1, rank: int = 0, kv_heads: int = 2, **parallel: Any) -> Any:
    """What the connector reads of vLLM's config, for TP rank ``rank`` of ``tp`` (vLLM's own per-rank
    head count: ``max(1, kv_heads // tp)``, heads replicated when there are fewer than ranks)."""
    mc = SimpleNamespace(
        model=model, revision="r1", dtype=torch.float32, quantization=None, use_mla=False, is_hybrid=False,
        is_attention_free=False, max_model_len=512,
        hf_text_config=SimpleNamespace(num_hidden_layers=2), get_num_layers=lambda pc: 2,
        get_num_kv_heads=lambda pc: max(1, kv_heads // pc.tensor_parallel_size), get_head_size=lambda: 8,
        get_total_num_kv_heads=lambda: kv_heads,
    )
    pc = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank, **parallel)
    return SimpleNamespace(
        model_config=mc, parallel_config=pc,
        cache_config=SimpleNamespace(block_size=128, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
    )


EXTRA = {"overrides": {"tiers": {"host": {"capacity": "4MiB"}}}}


def test_each_rank_gets_its_head_slice_and_the_replicas_first_rank_writes(tmp_path: Path) -> None:
    tp2 = [cache_config_for(vllm_config("m", tp=2, rank=r, kv_heads=4), EXTRA) for r in range(2)]
    assert [(c.parallel.tp_rank, c.parallel.tp_size, c.parallel.total_kv_heads, c.model.num_kv_heads) for c in tp2] == [
        (0, 2, 4, 2), (1, 2, 4, 2)]
    assert [namespace_from_config(c).kv_head_range for c in tp2] == [(0, 2, 4), (2, 4, 4)]
    # 2 KV heads at TP 4: vLLM replicates each head on two ranks; the first of each pair writes.
    tp4 = [namespace_from_config(cache_config_for(vllm_config("m", tp=4, rank=r), EXTRA)) for r in range(4)]
    assert [n.kv_head_range for n in tp4] == [(0, 1, 2), (0, 1, 2), (1, 2, 2), (1, 2, 2)]
    assert [n.writes_storage for n in tp4] == [True, False, True, False]
    assert tp4[0].digest == tp4[1].digest != tp4[2].digest
    # vLLM's global rank counts DP x PP x TP: the TP rank is the rank modulo tp_size.
    assert worker_rank(vllm_config("m", tp=2, rank=5)) == 1
    # A single rank is the whole model, in the namespace it always had.
    single = namespace_from_config(cache_config_for(vllm_config("m"), EXTRA))
    assert single.kv_head_range == (0, 2, 2) and single.writes_storage


@pytest.mark.parametrize(
    ("parallel", "match"),
    [({"pipeline_parallel_size": 2}, "pipeline_parallel_size 2"),
     ({"decode_context_parallel_size": 2}, "decode_context_parallel_size 2")],
)
def test_pipeline_and_context_parallel_engines_are_refused(parallel: dict, match: str) -> None:
    config = vllm_config("m", tp=2)
    for k, v in parallel.items():
        setattr(config.parallel_config, k, v)
    with pytest.raises(UnsupportedModelError, match=match):
        cache_config_for(config, EXTRA)


def test_a_lookup_agrees_on_the_fewest_tokens_any_rank_holds() -> None:
    assert agree_lookups([{"tokens": 256}, {"tokens": 128}, {"tokens": 256}])["tokens"] == 128
    assert agree_lookups([{"tokens": 256}, None])["tokens"] == 0  # a rank that cannot answer holds nothing
    assert agree_lookups([{"tokens": 256}, {"tokens": 256}]) == {"tokens": 256, "ranks": [256, 256]}


def test_the_scheduler_counts_a_prefix_only_where_every_rank_holds_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks' workers (each its own event loop, cache and socket, like vLLM's worker processes)
    over one shared file tier, each with the settings vLLM would pass for TP 2 of a 2-KV-head model."""
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    extra = {"overrides": {"tiers": {"host": {"capacity": "4MiB"}, "storage": [
        {"kind": "file", "path": str(tmp_path / "pages")}]}, "policies": {"prefetch_threshold_tokens": 0}}}
    configs = [cache_config_for(vllm_config("m", tp=2, rank=r), extra) for r in range(2)]
    assert [c.model.num_kv_heads for c in configs] == [1, 1]
    a, b = make_tokens(3 * 128, seed=1), make_tokens(3 * 128, seed=2)
    with ExitStack() as stack:
        workers, stacks = [], []
        for rank, config in enumerate(configs):
            own = stack.enter_context(ExitStack())  # one worker's life: closed alone below
            portal = own.enter_context(start_blocking_portal())
            service = own.enter_context(
                portal.wrap_async_context_manager(CacheService(config, socket_path("engine-tp", rank))))
            workers.append((portal, service))
            stacks.append(own)
        channels = RankChannels("engine-tp", 2, timeout_s=2, connect_timeout_s=0.2)
        stack.callback(channels.close)

        def store(rank: int, tokens: list[int]) -> None:
            portal, service = workers[rank]
            portal.call(service.cache.store, tokens, make_kv(configs[rank], len(tokens), seed=rank))
            portal.call(service.cache.wait_idle)

        def lookup(tokens: list[int], prefetch: bool = False) -> int:
            reply = channels.call({"op": "lookup", "req": "r", "tokens": tokens, "prefetch": prefetch})
            assert reply is not None
            return reply["tokens"]

        store(0, a)  # rank 0 holds A (and writes its head of it to the shared tier) ...
        assert lookup(a) == 0  # ... rank 1 does not, and never reads rank 0's head from the tier
        store(1, a[:128])
        assert lookup(a) == 128  # the one page both hold
        store(1, a)
        assert lookup(a) == 3 * 128
        store(0, b)
        store(1, b)
        assert lookup(b, prefetch=True) == 3 * 128
        assert channels.call({"op": "forget", "req": "r"}) == {}
        # Every lookup reached every rank.
        assert [service.counters.lookups for _, service in workers] == [4, 4]
        # Each rank wrote its own head of A and B to the one tier.
        assert [service.cache.stats().storage["file"].stored_pages for _, service in workers] == [6, 6]
        # Rank 1's worker is gone: rank 0 still holds everything, but nothing counts.
        stacks[1].close()
        assert channels.call({"op": "lookup", "req": "r", "tokens": a, "prefetch": False}) == {
            "tokens": 0, "ranks": [3 * 128, 0]}
        assert channels.failures >= 1
