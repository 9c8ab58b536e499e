"""The scheduler's side of hicache's KV events inside vLLM (integrations/vllm/events.py), without an
engine: hashes rewritten into vLLM's own, tensor-parallel ranks agreed, removals mapped."""

from __future__ import annotations

from typing import Any

import pytest

# vLLM's imports warn of deprecations that are not ours to fail on: they are made in the fixture.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def v() -> Any:
    import types

    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    from hicache.events import base as ours
    from hicache.integrations.vllm.events import HiCacheKVEvents, SchedulerEvents, _to_vllm

    hash_fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(hash_fn)
    return types.SimpleNamespace(BlockRemoved=BlockRemoved, BlockStored=BlockStored, kv=kv_cache_utils, ours=ours,
                                 HiCacheKVEvents=HiCacheKVEvents, SchedulerEvents=SchedulerEvents, to_vllm=_to_vllm,
                                 HASH=hash_fn)


def _vllm_hashes(v: Any, tokens: list[int], bs: int) -> list[int]:
    out, parent = [], None
    for i in range(0, len(tokens), bs):
        parent = v.kv.hash_block_tokens(v.HASH, parent, tokens[i : i + bs])
        out.append(v.kv.maybe_convert_block_hash(parent))
    return out


def _step(v: Any, *workers: list[Any]) -> Any:
    agg = v.HiCacheKVEvents([v.to_vllm(e) for e in workers[0]])
    for w in workers[1:]:
        agg.add_events([v.to_vllm(e) for e in w])
    return agg


def test_hashes_are_vllms_own_and_chain_across_events(v: Any) -> None:
    ours = v.ours
    s = v.SchedulerEvents(4, 4, v.HASH)
    tokens = list(range(12))
    want = _vllm_hashes(v, tokens, 4)
    s.add(_step(v, [ours.BlockStored([11, 12], None, tokens[:8], 4, "CPU"),
                 ours.BlockStored([13], 12, tokens[8:], 4, "DISK")]))
    first, second = s.take()
    assert isinstance(first, v.BlockStored) and first.block_hashes == want[:2] and first.parent_block_hash is None
    assert second.block_hashes == want[2:] and second.parent_block_hash == want[1] and second.medium == "DISK"
    s.add(_step(v, [ours.BlockRemoved([12], "CPU")]))
    (removed,) = s.take()
    assert isinstance(removed, v.BlockRemoved) and removed.block_hashes == [want[1]] and removed.medium == "CPU"
    # a block whose parent was never announced cannot be given vLLM's hash: left out, counted
    s.add(_step(v, [ours.BlockStored([99], 98, tokens[:4], 4, "CPU")]))
    assert s.take() == [] and s.untranslated == 1


def test_only_what_every_rank_announced_goes_out_even_across_steps(v: Any) -> None:
    ours = v.ours
    s = v.SchedulerEvents(4, 4, v.HASH)
    a = ours.BlockStored([1], None, [1, 2, 3, 4], 4, "CPU")
    b = ours.BlockStored([2], 1, [5, 6, 7, 8], 4, "CPU")
    s.add(_step(v, [a, b], [a]))  # rank 1 has not finished writing its slice of b yet
    assert [e.block_hashes for e in s.take()] == [_vllm_hashes(v, [1, 2, 3, 4], 4)]
    s.add(_step(v, [], [b]))  # the next step: now both have it
    assert [e.block_hashes for e in s.take()] == [_vllm_hashes(v, list(range(1, 9)), 4)[1:]]
    assert s.take() == []


def test_ranks_that_group_a_chain_differently_still_agree_block_by_block(v: Any) -> None:
    ours = v.ours
    s = v.SchedulerEvents(4, 4, v.HASH)
    tokens = list(range(1, 13))
    whole = ours.BlockStored([1, 2, 3], None, tokens, 4, "CPU")
    split = [ours.BlockStored([1, 2], None, tokens[:8], 4, "CPU"), ours.BlockStored([3], 2, tokens[8:], 4, "CPU")]
    s.add(_step(v, [whole], split))
    assert [h for e in s.take() for h in e.block_hashes] == _vllm_hashes(v, tokens, 4)
    # an empty step of one rank (always handed over under TP) keeps the ranks' lists apart
    empty = v.HiCacheKVEvents([], always=True)
    assert bool(empty) and not bool(v.HiCacheKVEvents([]))
