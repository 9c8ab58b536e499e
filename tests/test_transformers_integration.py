"""The transformers integration with a real (tiny, random) Llama: restored prefixes give the logits of a
full prefill, from every tier and after a restart; greedy outputs do not change."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from hicache import HiCache, InvalidRequestError, InvalidTokensError, UnsupportedModelError
from hicache.integrations.transformers import CachedCausalLM, ModelSpec, model_fingerprint, model_overrides

from .helpers import assert_consistent
from .lm_helpers import PAGE, full_prefill_logits, greedy, lm_config, prompt, run, tiny_model

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")

MODEL = tiny_model()


def test_model_overrides_read_the_geometry_from_the_model() -> None:
    spec = ModelSpec.of(MODEL)
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, "float32")
    model = model_overrides(MODEL)["model"]
    assert model["num_layers"] == 2 and model["revision"] == model_fingerprint(MODEL)
    other = tiny_model(seed=1)  # same architecture, other weights: another namespace
    assert model_fingerprint(other) != model_fingerprint(MODEL)


def test_a_config_for_another_geometry_is_rejected(tmp_path: Path) -> None:
    config = lm_config(MODEL, None, model=model_overrides(MODEL)["model"] | {"num_layers": 3})
    with pytest.raises(UnsupportedModelError, match="num_layers"):
        CachedCausalLM(MODEL, HiCache.from_config(config))


def test_a_config_without_the_models_sliding_layers_is_rejected() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=1000, sliding_window=32)
    model = MistralForCausalLM(cfg)
    with pytest.raises(UnsupportedModelError, match="model.layers: config .*sliding"):
        ModelSpec.of(model).check(lm_config(MODEL, None))


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "all-layers-first"])
async def test_a_prefix_restored_from_the_device_gives_the_logits_of_a_full_prefill(layerwise: bool) -> None:
    tokens = prompt(200, seed=1)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache, layerwise=layerwise)
        await run(lm, tokens[:150])  # stores 9 pages
        _, seq = await run(lm, tokens)
        assert seq.cached_tokens == 144 and seq.by_tier["device"] == 144
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)
        await cache.wait_idle()
        assert_consistent(cache)


#: how the restored prefix reaches the attention: copied into the model's cache and attended with
#: segment attention (the CPU default), left in the device pages (``attend_in_pages``), or copied
#: for the model's own attention
MODES = pytest.mark.parametrize("mode", [
    {"segment_attention": True},
    {"segment_attention": True, "attend_in_pages": True},
    {"segment_attention": False},
], ids=["segment-attention", "in-device-pages", "model-attention"])


@MODES
async def test_a_prefix_restored_from_the_host_gives_the_logits_of_a_full_prefill(mode: dict) -> None:
    tokens = prompt(130, seed=2)
    async with HiCache.from_config(lm_config(MODEL, None, device_pages=8)) as cache:
        lm = CachedCausalLM(MODEL, cache, **mode)
        await run(lm, tokens[:100])  # 6 pages
        await cache.wait_idle()  # backed up to the host
        await run(lm, prompt(130, seed=3))  # 8 pages: the first prompt's pages leave the device
        await cache.wait_idle()
        _, seq = await run(lm, tokens)
        assert seq.by_tier["host"] == 96 and seq.by_tier["device"] == 0
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


async def test_a_prefix_restored_from_the_file_tier_gives_the_logits_of_a_full_prefill(tmp_path: Path) -> None:
    tokens = prompt(130, seed=4)
    config = lm_config(MODEL, tmp_path / "pages", device_pages=8, host_pages=8)
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(MODEL, cache)
        await run(lm, tokens[:100])
        await cache.wait_idle()
        for seed in (5, 6):  # 8 pages each: out of the device, then out of the host
            await run(lm, prompt(130, seed=seed))
            await cache.wait_idle()
        _, seq = await run(lm, tokens)
        assert seq.by_tier["file"] == 96, dict(seq.by_tier)
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


async def test_after_a_restart_the_file_tier_gives_the_same_logits_and_answer(tmp_path: Path) -> None:
    tokens = prompt(180, seed=7)
    config = lm_config(MODEL, tmp_path / "pages")
    async with HiCache.from_config(config) as cache:
        first, _ = await run(CachedCausalLM(MODEL, cache), tokens, new_tokens=5)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:  # a fresh cache: only the folder is left
        again, seq = await run(CachedCausalLM(MODEL, cache), tokens, new_tokens=5)
    assert seq.by_tier["file"] == 176 and seq.cached_tokens == 176
    assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens + again[:-1]), atol=1e-5)
    assert again == first == greedy(MODEL, tokens, 6)


@MODES
@pytest.mark.parametrize("length, pages", [(301, 0), (301, 9), (170, 10)], ids=["cold", "long-step", "short-step"])
async def test_a_prefill_and_its_decode_steps_give_the_models_own_answer(length: int, pages: int, mode: dict) -> None:
    """Prompts that end mid-page, cold and after a cached prefix: the rest computed in a step of
    at least ``SPLIT_MIN_QUERIES`` tokens (causal kernel and a merge) or of fewer (one masked call)."""
    tokens = prompt(length, seed=length + pages)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache, **mode)
        if pages:
            await run(lm, tokens[: pages * PAGE])
        out, seq = await run(lm, tokens, new_tokens=2)
        assert seq.cached_tokens == pages * PAGE
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens + out[:-1]), atol=1e-5)
        assert out == greedy(MODEL, tokens, 3)


async def test_a_fully_cached_prompt_recomputes_its_last_token() -> None:
    tokens = prompt(6 * PAGE, seed=8)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        await run(lm, tokens)
        _, seq = await run(lm, tokens)
        assert seq.by_tier["device"] == 6 * PAGE and seq.cached_tokens == 6 * PAGE - 1
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


@MODES
async def test_greedy_answers_are_the_same_with_and_without_the_cache(tmp_path: Path, mode: dict) -> None:
    """A three-turn chat under a cache so small that every turn restores from another tier."""
    config = lm_config(MODEL, tmp_path / "pages", device_pages=6, host_pages=6)
    turns = [prompt(70, seed=s) for s in (10, 11, 12)]
    answers: dict[str, list[list[int]]] = {}
    for name in ("none", "cache"):
        history: list[int] = []
        answers[name] = []
        async with HiCache.from_config(config) as cache:
            lm = CachedCausalLM(MODEL, cache if name == "cache" else None, **mode)
            for turn in turns:
                history += turn
                out, seq = await run(lm, history, new_tokens=4)
                answers[name].append(out)
                history += out
                await cache.wait_idle()
            if name == "cache":
                assert seq.cached_tokens > 0
    assert answers["none"] == answers["cache"]
    assert answers["none"][0] == greedy(MODEL, turns[0], 5)


async def test_the_computed_pages_of_prompt_and_answer_are_stored() -> None:
    tokens = prompt(100, seed=13)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        out, _ = await run(lm, tokens, new_tokens=40)  # 100 + 40 computed tokens: 8 full pages
        assert cache.stats().stored_pages == 140 // PAGE
        hit = await cache.lookup(tokens + out)
        assert hit.tokens == 140 // PAGE * PAGE


async def test_a_cancelled_prefill_releases_its_lease() -> None:
    tokens = prompt(300, seed=14)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        await run(lm, tokens[:200])
        with anyio.move_on_after(0.001):
            await run(lm, tokens)
        await cache.wait_idle()
        assert_consistent(cache)  # no pin left behind, every page accounted for
        _, seq = await run(lm, tokens)
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


async def test_bad_token_ids_are_rejected_before_anything_runs() -> None:
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache)
        for bad in ([], [5, -1], [5, 1000], [[1, 2]]):
            with pytest.raises(InvalidTokensError):
                async with lm.sequence(bad):
                    pass
        assert cache.stats().retrieves == 0


async def test_a_sequence_started_without_lookup_still_reads_the_file_tier(tmp_path: Path) -> None:
    tokens = prompt(100, seed=15)
    config = lm_config(MODEL, tmp_path / "pages")
    async with HiCache.from_config(config) as cache:
        await run(CachedCausalLM(MODEL, cache), tokens)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:
        async with CachedCausalLM(MODEL, cache).sequence(tokens) as seq:  # no lm.lookup() first
            await seq.prefill()
        assert seq.by_tier["file"] == 96
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)


@MODES
async def test_a_prefix_over_scattered_device_pages_is_restored_in_place(mode: dict) -> None:
    tokens = prompt(140, seed=16)
    async with HiCache.from_config(lm_config(MODEL, None)) as cache:
        lm = CachedCausalLM(MODEL, cache, **mode)
        await run(lm, tokens[:64])  # pages 0-3
        await run(lm, prompt(64, seed=17))  # pages 4-7: the next pages of `tokens` go elsewhere
        await run(lm, tokens[:129])  # pages 8-11
        _, seq = await run(lm, tokens)
        assert seq.cached_tokens == 128 and len(seq._runs) == 2  # two runs of consecutive pages
        assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens), atol=1e-5)
        assert seq.stages["prefill_compute"] > 0 and seq.stages["retrieve"] > 0
        assert (seq.stages["restore_copy"] > 0) == (not mode.get("attend_in_pages"))  # in the pages: no copies


@MODES
async def test_a_sequence_longer_than_its_model_cache_grows_it(mode: dict) -> None:
    tokens = prompt(40, seed=18)
    lm = CachedCausalLM(MODEL, None, **mode)
    async with lm.sequence(tokens, max_new_tokens=1) as seq:  # a buffer of 128 tokens
        out = [await seq.prefill()]
        for _ in range(130):
            out.append(await seq.decode(out[-1]))
    assert torch.allclose(seq.logits, full_prefill_logits(MODEL, tokens + out[:-1]), atol=1e-4)
    with pytest.raises(InvalidRequestError):  # the block has exited: its buffers went back
        await seq.decode(out[-1])


async def test_model_cache_buffers_are_reused_between_sequences() -> None:
    lm = CachedCausalLM(MODEL, None)
    for seed in (19, 20):
        tokens = prompt(50, seed=seed)
        out, seq = await run(lm, tokens, new_tokens=3)
        assert out == greedy(MODEL, tokens, 4)
    assert len(lm.buffers._idle) == 1  # one buffer, taken and given back twice


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_prefix_restored_on_the_gpu_gives_the_logits_of_a_full_prefill(tmp_path: Path) -> None:
    model = tiny_model().cuda()
    tokens = prompt(200, seed=21)
    base = lm_config(model, tmp_path / "pages", device_pages=8, host_pages=32)
    page_bytes = base.page_bytes
    config = lm_config(model, tmp_path / "pages", tiers={
        "device": {"capacity": 8 * page_bytes, "device": "cuda"},
        "host": {"capacity": 32 * page_bytes, "pin_memory": True},
        "storage": [{"kind": "file", "path": str(tmp_path / "pages")}],
    })
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(model, cache)
        assert cache.device_kv.is_cuda and cache.controller.host.pin_memory
        await run(lm, tokens[:100])
        await cache.wait_idle()
        await run(lm, prompt(130, seed=22))  # 8 pages: the first prompt's pages leave the device
        await cache.wait_idle()
        _, seq = await run(lm, tokens)
        assert seq.by_tier["host"] == 96
    with torch.inference_mode():
        expected = model(input_ids=torch.tensor([tokens], device="cuda"), use_cache=False).logits[0, -1].float()
    assert torch.allclose(seq.logits, expected, atol=1e-4)


def test_segment_attention_is_only_switched_on_for_our_own_forwards() -> None:
    lm = CachedCausalLM(MODEL, None)
    assert lm.segments  # on the CPU
    impl = MODEL.config._attn_implementation
    tokens = prompt(30, seed=23)
    anyio.run(run, lm, tokens)
    assert MODEL.config._attn_implementation == impl  # the model is left as it was
    assert torch.allclose(full_prefill_logits(MODEL, tokens), full_prefill_logits(tiny_model(), tokens))


def test_attending_in_the_device_pages_needs_segment_attention() -> None:
    with pytest.raises(UnsupportedModelError, match="attend_in_pages"):
        CachedCausalLM(MODEL, None, segment_attention=False, attend_in_pages=True)
