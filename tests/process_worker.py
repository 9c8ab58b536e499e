"""A separate engine process for the cross-process tests: ``python -m tests.process_worker ...``.

    store DIR FIRST COUNT   store prompts FIRST..FIRST+COUNT-1 (write-through to the file tier), exit
    check DIR FIRST COUNT   in a fresh cache: look up and retrieve each prompt, compare bit by bit

Prints one JSON line. Prompt ``i`` and its KV are derived from seed ``i``, so every process agrees
on them without sharing anything but the folder.
"""

from __future__ import annotations

import json
import sys

import anyio
import torch

from hicache import HiCache

from .conftest import make_config, make_kv, make_tokens

PROMPT_PAGES = 6


def config(root: str):
    return make_config(
        64, 256,
        tiers={"storage": [{"kind": "file", "path": root}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )


def prompt(cfg, i: int) -> tuple[list[int], torch.Tensor]:
    tokens = make_tokens(PROMPT_PAGES * cfg.page_size, seed=i)
    return tokens, make_kv(cfg, len(tokens), seed=1000 + i)


async def store(root: str, first: int, count: int) -> dict:
    cfg = config(root)
    async with HiCache.from_config(cfg) as cache:
        for i in range(first, first + count):
            await cache.store(*prompt(cfg, i))
        await cache.wait_idle()
        s = cache.stats().storage["file"]
        return {"stored_pages": s.stored_pages, "skipped_pages": s.skipped_pages, "failures": s.failures}


async def check(root: str, first: int, count: int) -> dict:
    cfg = config(root)
    hits, exact = [], []
    async with HiCache.from_config(cfg) as cache:
        for i in range(first, first + count):
            tokens, kv = prompt(cfg, i)
            hit = await cache.lookup(tokens)
            hits.append(hit.by_tier["file"])
            async with cache.retrieve(tokens) as view:
                await view.wait_all()
                ok = view.tokens == len(tokens)
                for layer in range(kv.shape[1]):
                    k, v = view.layer(layer)
                    n = view.tokens
                    ok = ok and torch.equal(k, kv[0, layer, :n]) and torch.equal(v, kv[1, layer, :n])
                exact.append(ok)
        s = cache.stats().storage["file"]
        return {"file_hits": hits, "exact": exact, "corrupt": s.backend.corrupt_pages, "fetched": s.fetched_pages}


def main() -> None:
    verb, root, first, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    result = anyio.run({"store": store, "check": check}[verb], root, first, count)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
