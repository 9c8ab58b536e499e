"""One burst over a hybrid model's layouts (sliding-window, recurrent): concurrent stores,
retrieves and lookups, some cancelled, over a slow layer-split storage tier; then the checks both
layouts share (nothing leaked or lost) and the layout's own (``Checks``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from hicache import HiCache, HiCacheConfig
from hicache.leases import RetrieveView
from hicache.tiers.storage.layer_split import LayerSplitTier

from ..helpers import assert_consistent
from .conftest import PAGE, Storage, pressure_config
from .prefix_kv import prefix_kv
from .test_bursts import Call


@dataclass(frozen=True)
class Checks:
    """What a layout promises: ``model`` its geometry, ``store_kwargs`` a store's extra arguments
    (a recurrent model's checkpoints), ``check_view`` every retrieve's view, ``after`` what a fresh
    cache over the store gets back under write-through (``stored``: the prompts stored, full pages)."""

    model: dict[str, Any]
    check_view: Callable[[RetrieveView, list[int]], Awaitable[None]]
    after: Callable[[HiCacheConfig, list[list[int]]], Awaitable[None]]
    store_kwargs: Callable[[list[int]], dict[str, Any]] = lambda tokens: {}


async def run_hybrid_burst(
    storage: Storage, write: str, prompts: list[list[int]], calls: list[Call], close_at_once: bool, checks: Checks
) -> None:
    longest = max(len(p) for p in prompts) // PAGE
    config = pressure_config(longest, longest + 2, [storage.slowed()], model=checks.model, write=write,
                             prefetch="wait_complete", prefetch_threshold_tokens=0)
    stored: list[list[int]] = []

    async def call(c: Call, cache: HiCache) -> None:
        tokens = prompts[c.prompt % len(prompts)]
        with anyio.move_on_after(c.cancel_after_s if c.cancel_after_s is not None else float("inf")):
            if c.verb == "store":
                result = await cache.store(tokens, prefix_kv(tokens), **checks.store_kwargs(tokens))
                stored.append(tokens[: result.cached_tokens + result.stored_tokens])
            elif c.verb == "retrieve":
                async with cache.retrieve(tokens) as view:
                    await checks.check_view(view, tokens)
            else:
                hit = await cache.lookup(tokens)
                assert hit.tokens % PAGE == 0 and hit.tokens <= len(tokens)
                if hit.prefetch is not None:
                    hit.prefetch.cancel()

    async with HiCache.from_config(config) as cache:
        assert isinstance(cache.controller.storage[0], LayerSplitTier)
        async with anyio.create_task_group() as tg:
            for c in calls:
                tg.start_soon(call, c, cache)
        if not close_at_once:
            await cache.wait_idle()
            assert_consistent(cache)
    assert cache.stats().lost_pages == 0
    if write == "write_through":
        await checks.after(config, stored)
