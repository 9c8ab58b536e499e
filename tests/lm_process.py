"""A process that serves one prompt through the transformers integration (for test_lm_cross_process).

    python -m tests.lm_process PAGES_DIR PROMPT_SEED EXTRA_TOKENS

prints one JSON line: the greedy answer, where the cached prefix came from, and whether the
logits match a full prefill and the answer matches decoding without any cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import torch

from hicache import HiCache
from hicache.integrations.transformers import CachedCausalLM

from .lm_helpers import full_prefill_logits, greedy, lm_config, prompt, tiny_model


async def main(pages: Path, seed: int, extra: int) -> dict:
    model = tiny_model()
    tokens = prompt(150, seed) + prompt(extra, seed + 1000)
    async with HiCache.from_config(lm_config(model, pages)) as cache:
        lm = CachedCausalLM(model, cache)
        await lm.lookup(tokens)
        async with lm.sequence(tokens) as seq:
            out = [await seq.prefill()]
            logits_ok = bool(torch.allclose(seq.logits, full_prefill_logits(model, tokens), atol=1e-5))
            for _ in range(3):
                out.append(await seq.decode(out[-1]))
        await cache.wait_idle()
    return {
        "output": out,
        "by_tier": dict(seq.by_tier),
        "cached_tokens": seq.cached_tokens,
        "logits_ok": logits_ok,
        "matches_no_cache": out == greedy(model, tokens, 4),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    result = anyio.run(main, Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps(result))
