"""The worker side's copies without an engine: a step's held pages go into vLLM's blocks before its
first attention layer, every layer at once, and its new pages are copied out of the blocks when
the step ends, only if vLLM's forward reached every layer (a partial page is never kept).

Real pieces: the ``WorkerSide`` with its cache service and a real host tier; vLLM's KV layers are
plain tensors in its CPU attention layout, named as vLLM names them. No engine runs, but the
worker side imports vLLM's connector classes, so the imports are made in the tests (vLLM's own
deprecation warnings at import are not ours to fail on).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import load_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYERS, HEADS, DIM, BLOCK = 3, 2, 8, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[Any]:
    from hicache.integrations.vllm.worker_side import WorkerSide

    config = load_config(overrides={
        "model": {"name": "copies-test", "num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM,
                  "dtype": "float32"},
        "page_size": BLOCK,
        "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "1MiB"}},
    }, env={})
    side = WorkerSide(config, BLOCK, str(tmp_path / "w.sock"))
    gen = torch.Generator().manual_seed(0)
    side.start({name: torch.randn((8, HEADS, BLOCK, 2 * DIM), generator=gen) for name in NAMES})
    try:
        yield side
    finally:
        side.shutdown()


def _kv(side: Any) -> list[torch.Tensor]:
    """vLLM's layers as tensors (the worker keeps them as integer-word views)."""
    return [torch.from_numpy(side.layers[name][1]).view(torch.float32).view(8, HEADS, BLOCK, 2 * DIM) for name in NAMES]


def _step(side: Any, meta: Any, layers: list[str]) -> None:
    """One step as vLLM runs it: bind, then each layer's load and save hooks, then the step's end."""
    side.bind(meta)
    for name in layers:
        side.before_layer(name)
        side.after_layer(name, torch.empty(0))
    side.end_step()


def _cached(side: Any, tokens: list[int]) -> int:
    assert side.portal is not None and side.service is not None and side.service.cache is not None
    return side.portal.call(side.service.cache.lookup, tokens).tokens


def test_a_step_that_reaches_every_layer_saves_pages_that_load_back_bit_exact(worker: Any) -> None:
    from hicache.integrations.vllm.metadata import HiCacheMetadata, LoadSpec, SaveSpec

    tokens = list(range(1, 2 * BLOCK + 1))
    kv = _kv(worker)
    saved = [layer[[2, 5]].clone() for layer in kv]
    _step(worker, HiCacheMetadata(saves=[SaveSpec("a", tokens, 0, 2, ([2, 5],))]), NAMES)
    worker.portal.call(worker.service.settle)
    assert _cached(worker, tokens) == 2 * BLOCK
    # Load them into two other blocks: exactly those change, to the saved KV, every layer.
    for layer in kv:
        layer[[1, 7]] = 0.0
    before = [layer.clone() for layer in kv]
    _step(worker, HiCacheMetadata(loads=[LoadSpec("b", tokens, 0, 2, ([7, 1],))]), NAMES)
    for layer, want, old in zip(kv, saved, before):
        assert torch.equal(layer[7], want[0]) and torch.equal(layer[1], want[1])
        assert torch.equal(layer[[0, 2, 3, 4, 5, 6]], old[[0, 2, 3, 4, 5, 6]])


def test_a_step_whose_forward_stopped_short_of_a_layer_keeps_nothing(worker: Any) -> None:
    from hicache.integrations.vllm.metadata import HiCacheMetadata, SaveSpec

    tokens = list(range(100, 100 + BLOCK))
    _step(worker, HiCacheMetadata(saves=[SaveSpec("a", tokens, 0, 1, ([3],))]), NAMES[:-1])
    worker.portal.call(worker.service.settle)
    assert _cached(worker, tokens) == 0
    assert worker.service.counters.save_skipped_pages == 1
    # The same save with every layer is kept: the refusal above was the missing layer's.
    _step(worker, HiCacheMetadata(saves=[SaveSpec("a", tokens, 0, 1, ([3],))]), NAMES)
    worker.portal.call(worker.service.settle)
    assert _cached(worker, tokens) == BLOCK
