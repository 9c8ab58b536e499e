"""An engine process sharing a storage tier: ``python -m tests.remote_worker VERB TIER_JSON FIRST COUNT``.

    store   store prompts FIRST..FIRST+COUNT-1 (write-through to the tier); with --hold, stay alive
            until stdin closes (a Mooncake client's pages live in its own segment)
    check   in a fresh cache with that tier only: look up and retrieve each prompt, compare bit by bit

``TIER_JSON`` is one ``tiers.storage`` entry (a file folder, a Valkey server, a Mooncake cluster).
Prints one JSON line. Prompt ``i`` and its KV derive from seed ``i``: the processes share nothing
but the tier.
"""

from __future__ import annotations

import json
import sys

import anyio
import torch

from hicache import HiCache

from .conftest import make_config, make_kv, make_tokens

PROMPT_PAGES = 6


def config(tier: dict):
    return make_config(
        64, 256,
        tiers={"storage": [tier]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


def prompt(cfg, i: int) -> tuple[list[int], torch.Tensor]:
    tokens = make_tokens(PROMPT_PAGES * cfg.page_size, seed=i)
    return tokens, make_kv(cfg, len(tokens), seed=1000 + i)


async def store(tier: dict, first: int, count: int, hold: bool) -> None:
    cfg = config(tier)
    async with HiCache.from_config(cfg) as cache:
        for i in range(first, first + count):
            await cache.store(*prompt(cfg, i))
        await cache.wait_idle()
        s = cache.stats().storage[cfg.tiers.storage[0].tier_name]
        out = {"stored_pages": s.stored_pages, "skipped_pages": s.skipped_pages, "failures": s.failures}
        print(json.dumps(out), flush=True)
        if hold:
            await anyio.to_thread.run_sync(sys.stdin.read)


async def check(tier: dict, first: int, count: int, hold: bool) -> None:
    cfg = config(tier)
    name = cfg.tiers.storage[0].tier_name
    hits, exact = [], []
    async with HiCache.from_config(cfg) as cache:
        for i in range(first, first + count):
            tokens, kv = prompt(cfg, i)
            hits.append((await cache.lookup(tokens)).by_tier[name])
            async with cache.retrieve(tokens) as view:
                await view.wait_all()
                ok = view.tokens == len(tokens)
                for layer in range(kv.shape[1]):
                    k, v = view.layer(layer)
                    n = view.tokens
                    ok = ok and torch.equal(k, kv[0, layer, :n]) and torch.equal(v, kv[1, layer, :n])
                exact.append(ok)
        s = cache.stats().storage[name]
        out = {"hits": hits, "exact": exact, "corrupt": s.backend.corrupt_pages, "fetched": s.fetched_pages}
        print(json.dumps(out), flush=True)


def main() -> None:
    verb, tier, first, count = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    anyio.run({"store": store, "check": check}[verb], tier, first, count, "--hold" in sys.argv)


if __name__ == "__main__":
    main()
