"""Sliding-window hybrids through the transformers integration (tiny random Gemma 3 and Mistral):
the layout is read from the model and kept in the namespace, and a restored prefix several windows
long gives the logits of a full prefill from every tier, in this process and the next."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCache, UnsupportedModelError
from hicache.containers import namespace_from_config
from hicache.integrations.transformers import CachedCausalLM, ModelSpec, model_overrides
from hicache.layer_kinds import from_hf_config

from .helpers import assert_consistent
from .lm_helpers import PAGE, full_prefill_logits, greedy, lm_config, prompt, run

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

WINDOW = 24  # not a multiple of the page: a window's first page is partly outside it
S, F = "sliding_attention", "full_attention"


def tiny_gemma3(seed: int = 0, window: int = WINDOW) -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=1000, sliding_window=window, layer_types=[S, S, F, S, S, F],
        max_position_embeddings=4096, initializer_range=0.1,
    )
    cfg._name_or_path = f"tiny-gemma3-seed{seed}"
    torch.manual_seed(seed)
    return Gemma3ForCausalLM(cfg).eval()


def tiny_mistral(seed: int = 0) -> Any:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000, sliding_window=WINDOW, initializer_range=0.1)
    torch.manual_seed(seed)
    return MistralForCausalLM(cfg).eval()


GEMMA = tiny_gemma3()


def test_the_layout_is_read_from_the_model_and_separates_namespaces() -> None:
    spec = ModelSpec.of(GEMMA)
    assert spec.layers.canonical() == f"sliding:{WINDOW}*2,full,sliding:{WINDOW}*2,full"
    assert spec.layers.sliding == (0, 1, 3, 4) and spec.layers.window == WINDOW
    assert ModelSpec.of(tiny_mistral()).layers.canonical() == f"sliding:{WINDOW}*2"
    config = lm_config(GEMMA, None)
    assert config.model.layers == spec.layers
    other_window = lm_config(GEMMA, None, model=model_overrides(GEMMA)["model"] | {
        "layers": [f"sliding:{WINDOW * 2}"] * 2 + ["full"] + [f"sliding:{WINDOW * 2}"] * 2 + ["full"]})
    all_full = lm_config(GEMMA, None, model=model_overrides(GEMMA)["model"] | {"layers": []})
    digests = {namespace_from_config(c).digest for c in (config, other_window, all_full)}
    assert len(digests) == 3, "a cache of one layout must never be served to another"
    with pytest.raises(UnsupportedModelError, match="layers"):
        CachedCausalLM(GEMMA, HiCache.from_config(all_full))


def test_layers_with_recurrent_state_are_refused_where_only_kv_is_cached_with_the_reason() -> None:
    """Engines' integrations read layouts from the Hugging Face config (``from_hf_config``); only the
    transformers integration checkpoints recurrent state (tests/test_recurrent_transformers.py)."""
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=1, head_dim=16, vocab_size=1000, num_experts=2, num_experts_per_tok=1,
                          moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_key_heads=2,
                          linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    with pytest.raises(UnsupportedModelError, match="linear_attention.*transformers integration"):
        from_hf_config("Qwen3Next", cfg)


def test_segment_attention_is_not_used_for_sliding_layers() -> None:
    assert CachedCausalLM(GEMMA, None).segments is False
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        CachedCausalLM(GEMMA, None, segment_attention=True)


@pytest.mark.parametrize("model", [GEMMA, tiny_mistral()], ids=["gemma3", "mistral"])
async def test_a_prefix_from_the_device_gives_the_logits_of_a_full_prefill(model: Any) -> None:
    tokens = prompt(200, seed=1)  # eight windows
    async with HiCache.from_config(lm_config(model, None)) as cache:
        lm = CachedCausalLM(model, cache)
        await run(lm, tokens[:150])
        _, seq = await run(lm, tokens)
        assert seq.cached_tokens == 144 and seq.by_tier["device"] == 144
        assert torch.allclose(seq.logits, full_prefill_logits(model, tokens), atol=1e-5)
        await cache.wait_idle()
        assert_consistent(cache)


async def test_a_prefix_from_the_host_gives_the_logits_of_a_full_prefill() -> None:
    tokens = prompt(130, seed=2)
    async with HiCache.from_config(lm_config(GEMMA, None, device_pages=8)) as cache:
        lm = CachedCausalLM(GEMMA, cache)
        await run(lm, tokens[:100])
        await cache.wait_idle()
        await run(lm, prompt(130, seed=3))  # the first prompt's pages leave the device
        await cache.wait_idle()
        _, seq = await run(lm, tokens)
        assert seq.by_tier["host"] == 96 and seq.by_tier["device"] == 0, dict(seq.by_tier)
        assert torch.allclose(seq.logits, full_prefill_logits(GEMMA, tokens), atol=1e-5)


async def test_a_prefix_from_the_file_tier_gives_the_logits_of_a_full_prefill(tmp_path: Path) -> None:
    tokens = prompt(130, seed=4)
    config = lm_config(GEMMA, tmp_path / "pages", device_pages=8, host_pages=8)
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(GEMMA, cache)
        await run(lm, tokens[:100])
        await cache.wait_idle()
        for seed in (5, 6):  # out of the device, then out of the host
            await run(lm, prompt(130, seed=seed))
            await cache.wait_idle()
        _, seq = await run(lm, tokens)
        assert seq.by_tier["file"] == 96, dict(seq.by_tier)
        assert torch.allclose(seq.logits, full_prefill_logits(GEMMA, tokens), atol=1e-5)


async def test_greedy_answers_over_a_multi_turn_chat_match_and_a_fresh_process_gets_them_back(
    tmp_path: Path,
) -> None:
    """Turns several windows long, tiers so small that every turn restores from another tier; then
    a fresh cache over the same folder serves the whole history from the file tier."""
    config = lm_config(GEMMA, tmp_path / "pages", device_pages=6, host_pages=6)
    turns = [prompt(70, seed=s) for s in (10, 11, 12)]
    answers: dict[str, list[list[int]]] = {}
    history: list[int] = []
    for name in ("none", "cache"):
        history = []
        answers[name] = []
        async with HiCache.from_config(config) as cache:
            lm = CachedCausalLM(GEMMA, cache if name == "cache" else None)
            for turn in turns:
                history += turn
                out, seq = await run(lm, history, new_tokens=4)
                answers[name].append(out)
                history += out
                await cache.wait_idle()
            if name == "cache":
                assert seq.cached_tokens >= 6 * PAGE  # as much as the host tier can stage
    assert answers["none"] == answers["cache"]
    assert answers["none"][0] == greedy(GEMMA, turns[0], 5)
    # A fresh cache: only the folder is left. The file tier keeps sliding layers near the ends of
    # what it stored only, so a hit ends there: the device must hold the whole history to take it
    # (a 6-page run of it ends where the sliding layers are absent, and is no hit).
    async with HiCache.from_config(config) as cache:
        again, seq = await run(CachedCausalLM(GEMMA, cache), history, new_tokens=3)
    assert seq.by_tier["file"] == 0 and again == greedy(GEMMA, history, 4), dict(seq.by_tier)
    roomy = lm_config(GEMMA, config.tiers.storage[0].options["path"], device_pages=32, host_pages=32)
    async with HiCache.from_config(roomy) as cache:
        probe = await cache.lookup(history, prefetch=False)
        again, seq = await run(CachedCausalLM(GEMMA, cache), history, new_tokens=3)
    # the last turn's prompt, less the page the 6-page device could not take at its store
    assert probe.tokens == probe.by_tier["file"] == 12 * PAGE, probe
    assert seq.by_tier["file"] == probe.tokens, dict(seq.by_tier)
    assert again == greedy(GEMMA, history, 4)


async def test_a_flipped_byte_in_a_sliding_layer_of_a_stored_page_shortens_the_hit_never_the_answer(
    tmp_path: Path,
) -> None:
    """A page is stored as its full layers, plus its sliding layers near the prompt's end: a byte
    flipped in a sliding part is a counted miss, the hit ends before that window (here: no hit),
    and a fresh cache still answers as the model does."""
    tokens = prompt(200, seed=20)
    config = lm_config(GEMMA, tmp_path / "pages")
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(GEMMA, cache), tokens)
        await cache.wait_idle()
    files = sorted(p for p in (tmp_path / "pages").rglob("*.kv") if p.is_file())
    pages = 200 // PAGE
    # the window's pages before the prompt's end, and the slack's before them
    window = config.model.layers.window_pages(PAGE) + -(-config.policies.window_slack_tokens // PAGE)
    sizes = sorted({f.stat().st_size for f in files})
    assert len(files) == pages + window and len(sizes) == 2  # every full part, the window's sliding parts
    sliding_parts = [f for f in files if f.stat().st_size == sizes[1]]  # 4 sliding layers, 2 full
    assert len(sliding_parts) == window
    victim = sliding_parts[0]
    raw = bytearray(victim.read_bytes())
    raw[128 + 5] ^= 0x10  # after the 128-byte header: layer 0 (sliding), keys
    victim.write_bytes(bytes(raw))
    async with HiCache.from_config(config) as cache:
        out, seq = await run(CachedCausalLM(GEMMA, cache), tokens, new_tokens=3)
        assert cache.stats().storage["file"].backend.corrupt_pages == 1
    assert seq.cached_tokens < 200 // PAGE * PAGE and seq.cached_tokens % PAGE == 0
    assert out == greedy(GEMMA, tokens, 4)
    assert torch.allclose(seq.logits, full_prefill_logits(GEMMA, tokens + out[:-1]), atol=1e-5)


@pytest.mark.parametrize("slack", [0, 128])
async def test_a_prompt_branching_off_a_prefix_read_back_thin_is_a_hit_once_computed(
    tmp_path: Path, slack: int
) -> None:
    """A stored prompt read back from the file tier holds its sliding layers in the window before
    its end only (and the slack's before it, where the tier kept them: ``window_slack_tokens``).
    Without slack, a prompt that branches off 3 pages before that end finds thin pages in its
    window: it is computed whole, and its store fills that window in, so the next prompt on the
    same branch point is a hit in memory and from a fresh process. With the default slack, the
    read-back already holds that window: the first branch is a hit. Answers as the model's own."""
    policies = {"prefetch": "wait_complete", "prefetch_threshold_tokens": PAGE, "window_slack_tokens": slack}
    config = lm_config(GEMMA, tmp_path / "pages", device_pages=32, host_pages=32, policies=policies)
    doc = prompt(200, seed=30)
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(GEMMA, cache), doc + prompt(20, seed=31))
        await cache.wait_idle()
    asks = [doc[:160] + prompt(20, seed=32 + q) for q in range(3)]  # branch at page 10 of 13
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(GEMMA, cache)
        _, seq = await run(lm, doc + prompt(20, seed=31))
        assert seq.by_tier["file"] == 208  # the first prompt, back from the file tier (13 pages)
        out, seq = await run(lm, asks[0], new_tokens=3)
        assert seq.cached_tokens == (160 if slack else 0)  # without slack: a window reaching into thin pages
        assert out == greedy(GEMMA, asks[0], 4)
        out, seq = await run(lm, asks[1], new_tokens=3)
        assert seq.cached_tokens == 160 and out == greedy(GEMMA, asks[1], 4)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:
        out, seq = await run(CachedCausalLM(GEMMA, cache), asks[2], new_tokens=3)
    assert seq.by_tier["file"] == 160 and out == greedy(GEMMA, asks[2], 4), dict(seq.by_tier)
