"""The worker side under vLLM's hybrid KV cache manager, without an engine: one block table per KV
cache group, sliding groups holding vLLM's null block behind their window, loads vLLM waits for.

A three-layer model (sliding, full, sliding; window 32 tokens, 16-token pages and blocks) in
three groups of one layer, the three layers sharing one tensor as vLLM lays them out. One worker
saves a six-page prompt through a real file tier, which keeps the sliding layers of the last
``window_pages`` (3) pages only; a fresh worker loads it back from there:

* into the blocks vLLM gives a 96-token hit (sliding groups: null for pages 0-3, the window's
  blocks for 4-5): every block filled bit for bit, the null block untouched, reported received;
* into sliding blocks live from page 2 on (a page held thin would land in one): reported failed
  (vLLM then recomputes the request whole), never zeros served as KV.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import load_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HEADS, DIM, BLOCK, BLOCKS = 2, 8, 16, 24
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]
GROUPS = {NAMES[0]: 1, NAMES[1]: 0, NAMES[2]: 2}  # group 0: the full layer; 1 and 2: a sliding layer each
TOKENS = list(range(1, 6 * BLOCK + 1))
SENTINEL = 7.0


def _worker(tmp_path: Path, name: str) -> Any:
    from hicache.integrations.vllm.worker_side import WorkerSide

    config = load_config(overrides={
        "model": {"name": "groups-test", "num_layers": 3, "num_kv_heads": HEADS, "head_dim": DIM,
                  "dtype": "float32", "layers": ["sliding:32", "full", "sliding:32"]},
        "page_size": BLOCK,
        "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "1MiB"},
                  "storage": [{"kind": "file", "path": str(tmp_path / "pages"), "fsync": "never"}]},
        # no window slack: the file tier keeps the last window's sliding layers only
        "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0,
                     "window_slack_tokens": 0},
    }, env={})
    side = WorkerSide(config, BLOCK, str(tmp_path / f"{name}.sock"), layer_groups=GROUPS)
    shared = torch.zeros((BLOCKS, HEADS, BLOCK, 2 * DIM))  # vLLM: one tensor per position, shared by its groups
    side.start({n: shared for n in NAMES})
    return side


def _kv(side: Any) -> torch.Tensor:
    return torch.from_numpy(side.layers[NAMES[0]][1]).view(torch.float32).view(BLOCKS, HEADS, BLOCK, 2 * DIM)


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """The prompt's KV as the saving worker's blocks held it, per layer and page; its pages in the file tier."""
    side = _worker(tmp_path, "saver")
    try:
        from hicache.integrations.vllm.metadata import HiCacheMetadata, SaveSpec

        blocks = ([1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18])
        kv = _kv(side)
        kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
        kv[0] = 0.0  # the null block
        want = {name: [kv[blocks[GROUPS[name]][j]].clone() for j in range(6)] for name in NAMES}
        side.bind(HiCacheMetadata(saves=[SaveSpec("a", TOKENS, 0, 6, blocks)]))
        for name in NAMES:
            side.after_layer(name, torch.empty(0))
        side.end_step()
        side.portal.call(side.service.settle)
    finally:
        side.shutdown()
    yield want


def _load(tmp_path: Path, blocks: tuple[list[int], ...]) -> tuple[Any, set[str], set[str], torch.Tensor]:
    from hicache.integrations.vllm.metadata import HiCacheMetadata, LoadSpec

    side = _worker(tmp_path, "loader")
    _kv(side).fill_(SENTINEL)  # what vLLM's blocks hold before the load: any copy shows
    side.bind(HiCacheMetadata(async_loads=[LoadSpec("b", TOKENS, 0, 6, blocks)]))
    side.end_step()
    _, received, failed = side.take_finished(set())
    side.portal.call(side.service.settle)  # a step's loads are counted on the loop, after vLLM moves on
    return side, received, failed, _kv(side).clone()


def test_a_load_fills_each_groups_blocks_and_never_the_null_block(tmp_path: Path, saved: dict[str, Any]) -> None:
    full = [19, 20, 21, 22, 23, 1]
    blocks = (full, [0, 0, 0, 0, 2, 3], [0, 0, 0, 0, 4, 5])  # a 96-token hit: window 32 keeps blocks 4-5
    side, received, failed, kv = _load(tmp_path, blocks)
    try:
        assert received == {"b"} and failed == set()
        assert side.service.counters.loaded_by_tier == {"file": 6 * BLOCK}
        for name in NAMES:
            ids = blocks[GROUPS[name]]
            for j, block in enumerate(ids):
                if block:
                    assert torch.equal(kv[block], saved[name][j]), (name, j)
        assert (kv[0] == SENTINEL).all()  # the null block: nothing was copied there
    finally:
        side.shutdown()


def test_a_page_held_thin_is_never_copied_into_a_block_vllm_keeps(tmp_path: Path, saved: dict[str, Any]) -> None:
    blocks = ([19, 20, 21, 22, 23, 1], [0, 0, 6, 7, 2, 3], [0, 0, 8, 9, 4, 5])  # sliding blocks live from page 2
    side, received, failed, kv = _load(tmp_path, blocks)
    try:
        # Pages 0-2 came back without their sliding layers (the file tier keeps the last 3 pages' only).
        assert received == {"b"} and failed == {"b"}
        # Page 2's sliding blocks: neither zeros served as KV nor anything else.
        assert (kv[6] == SENTINEL).all() and (kv[8] == SENTINEL).all()
        assert side.service.counters.load_failures == 1
    finally:
        side.shutdown()
