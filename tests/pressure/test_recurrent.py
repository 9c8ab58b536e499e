"""A recurrent hybrid under pressure: bursts of concurrent stores (each naming its checkpoints),
retrieves and lookups, some cancelled, some closing the cache at once, over tight tiers and a slow
layer-split storage tier (the file tier, Valkey, Mooncake), beside two CPU burners.

After every burst: no page or lease leaked, nothing lost, and every retrieve ends on a checkpoint
and reads it exact (the state layers of its last page), with every full layer exact and the state
layers of the pages before it zeros or exact; under write-through, a fresh cache over the same
store continues every stored prompt from its end's checkpoint, and a shorter prompt after it only
from a checkpoint it read back.
"""

from __future__ import annotations

import os

import anyio
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache import HiCache, HiCacheConfig
from hicache.leases import RetrieveView

from ..helpers import assert_consistent
from .conftest import GEOMETRY, PAGE, Storage
from .hybrid_bursts import Checks, run_hybrid_burst
from .prefix_kv import prefix_kv  # a pure function of the prefix: a page's state layers stand for the state after it
from .test_bursts import Call, calls_st, fresh
from .test_sliding_window import prompts_st

# 4,000 and 2,048 bytes of state against 4,096-byte page slots: one state layer each, then the full one
RECURRENT = GEOMETRY | {"layers": ["recurrent:s=1000/float32", "recurrent:s=512/float32", "full"]}
STATE_LAYERS = (0, 1)
LONG = os.environ.get("HICACHE_PRESSURE_EXAMPLES")
def checkpoints(tokens: list[int]) -> list[int]:
    """After every second page, and where the prompt's full pages end."""
    full = len(tokens) // PAGE * PAGE
    return sorted({*range(2 * PAGE, full + 1, 2 * PAGE), full} - {0})


async def assert_continuable(view: RetrieveView, tokens: list[int], ends: list[list[int]]) -> None:
    n = view.tokens
    if n:
        assert (n // PAGE) % 2 == 0 or tokens[:n] in ends, f"a hit of {n} tokens ends without a checkpoint"
    kv = prefix_kv(tokens)
    low = max(0, n - PAGE)
    for layer in range(kv.shape[1]):
        await view.wait_layer(layer)
        for c, part in enumerate(view.layer(layer)):
            want = kv[c, layer, :n]
            if layer in STATE_LAYERS:
                assert torch.equal(part[low:], want[low:]), f"state layer {layer}: the checkpoint differs"
                head = part[:low]
                assert bool(((head == want[:low]) | (head == 0)).all()), f"state layer {layer}: a stale state"
            else:
                assert torch.equal(part, want), f"full layer {layer}: wrong KV"


async def after(config: HiCacheConfig, stored: list[list[int]]) -> None:
    for tokens in {tuple(t) for t in stored if t}:
        async with HiCache.from_config(config) as cache:  # only the store is left
            hit = await cache.lookup([*tokens, 7])
            async with cache.retrieve([*tokens, 7]) as view:
                assert view.tokens == hit.tokens == len(tokens), (view.tokens, hit.tokens, len(tokens))
                await assert_continuable(view, list(tokens), [list(tokens)])
            # Read back thin but for its last page: a shorter prompt continues only where it may.
            shorter = list(tokens[: len(tokens) - 2 * PAGE])
            async with cache.retrieve([*shorter, 7]) as view:
                await assert_continuable(view, shorter, [])
            await cache.wait_idle()
            assert_consistent(cache)


def checks(prompts: list[list[int]]) -> Checks:
    ends = [p[: len(p) // PAGE * PAGE] for p in prompts]
    return Checks(RECURRENT, lambda view, tokens: assert_continuable(view, tokens, ends), after,
                  lambda tokens: {"checkpoints": checkpoints(tokens)})


@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_bursts_keep_every_promise_with_recurrent_checkpoints(storage: Storage, write: str) -> None:
    examples = int(LONG) if LONG else (8 if storage.kind == "file" else 3)

    @settings(max_examples=examples, deadline=None, derandomize=not LONG,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(prompts=prompts_st, calls=calls_st, close_at_once=st.booleans())
    def run(prompts: list[list[int]], calls: list[Call], close_at_once: bool) -> None:
        anyio.run(run_hybrid_burst, fresh(storage), write, prompts, calls, close_at_once, checks(prompts))

    run()
