"""A tiny random-initialised Llama and cache configs sized in its pages, for the model tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from hicache import HiCacheConfig, load_config
from hicache.bench.models import load_model
from hicache.integrations.transformers import model_overrides

PAGE = 16


def tiny_model(seed: int = 0) -> Any:
    return load_model("tiny", seed=seed)


def lm_config(
    hf_model: Any,
    pages_dir: Path | None,
    *,
    device_pages: int = 64,
    host_pages: int = 128,
    **extra: Any,
) -> HiCacheConfig:
    """A config for ``hf_model`` whose tiers hold exactly the given pages (storage: a file tier)."""
    base = model_overrides(hf_model) | {"page_size": PAGE}
    page_bytes = load_config(overrides=base, env={}).page_bytes
    tiers: dict[str, Any] = {
        "device": {"capacity": device_pages * page_bytes, "device": "cpu"},
        "host": {"capacity": max(host_pages * page_bytes, 0), "pin_memory": False},
    }
    if pages_dir is not None:
        tiers["storage"] = [{"kind": "file", "path": str(pages_dir)}]
    overrides = base | {
        "tiers": tiers,
        "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE},
    }
    for key, value in extra.items():
        overrides[key] = value
    return load_config(overrides=overrides, env={})


def prompt(n: int, seed: int, vocab: int = 1000) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=gen).tolist()


def full_prefill_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0, -1].float()


def greedy(model: Any, tokens: list[int], n: int) -> list[int]:
    """Greedy decoding without any cache reuse: the reference answer."""
    out: list[int] = []
    seq = list(tokens)
    for _ in range(n):
        nxt = int(full_prefill_logits(model, seq).argmax())
        out.append(nxt)
        seq.append(nxt)
    return out


async def run(lm: Any, tokens: list[int], new_tokens: int = 0) -> tuple[list[int], Any]:
    """Lookup, prefill and ``new_tokens`` greedy decode steps through a ``CachedCausalLM``; the
    tokens and the sequence (for its figures)."""
    await lm.lookup(tokens)
    async with lm.sequence(tokens) as seq:
        out = [await seq.prefill()]
        for _ in range(new_tokens):
            out.append(await seq.decode(out[-1]))
    return out, seq
