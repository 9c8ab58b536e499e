"""What hicache needs to know about a Hugging Face model: its KV geometry and its identity."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ...dtype_names import DTYPE_NAMES
from ...errors import UnsupportedModelError
from ...layer_kinds import LayerKinds, from_hf_config

if TYPE_CHECKING:
    from ...config import HiCacheConfig

__all__ = ["ModelSpec", "cache_keyword", "model_fingerprint", "model_overrides"]

_FINGERPRINT_ATTR = "_hicache_fingerprint"


@dataclass(frozen=True)
class ModelSpec:
    """The KV geometry of a decoder-only model, read from its config."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    layers: LayerKinds = LayerKinds()  # per layer: full, sliding or recurrent (empty: every layer full)

    @classmethod
    def of(cls, model: Any) -> ModelSpec:
        cfg = model.config
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        for needed in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
            if getattr(text, needed, None) is None:
                raise UnsupportedModelError(f"{type(model).__name__}: config has no {needed}; not a decoder-only LM?")
        if getattr(text, "kv_lora_rank", None):
            raise UnsupportedModelError(f"{type(model).__name__}: latent-attention (MLA) caches are not supported yet")
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        dtype = DTYPE_NAMES.get(model.dtype)
        if dtype is None:
            raise UnsupportedModelError(f"{type(model).__name__}: dtype {model.dtype} is not supported")
        return cls(
            name=getattr(cfg, "_name_or_path", "") or type(model).__name__,
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            dtype=dtype,
            layers=_kinds(model, text),
        )

    def check(self, config: HiCacheConfig) -> None:
        """Raise ``UnsupportedModelError`` unless ``config`` caches KV of this geometry."""
        m = config.model
        if m.attention != "mha":
            raise UnsupportedModelError(f"config model.attention is {m.attention!r}; this integration caches K and V")
        want = {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
        want["dtype"] = self.dtype
        want["layers"] = self.layers
        wrong = [f"model.{k}: config {getattr(m, k)!r}, model {v!r}" for k, v in want.items() if getattr(m, k) != v]
        if wrong:
            raise UnsupportedModelError(
                "the cache config does not match the model (build it with model_overrides(model)): " + "; ".join(wrong)
            )


def cache_keyword(model: Any) -> str:
    """The name the model's forward takes its cache by: ``cache`` (transformers 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _kinds(model: Any, text: Any) -> LayerKinds:
    from .recurrent import layer_kinds  # imports transformers' cache classes

    recurrent = layer_kinds(model, text, cache_keyword(model))
    return recurrent if recurrent is not None else from_hf_config(type(model).__name__, text)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A digest of the model's weights (xxh3-128, about 20 ms per GB here), remembered on the model.

    Used as the namespace's ``revision``: KV computed by other weights under the same name is
    never served.
    """
    cached = getattr(model, _FINGERPRINT_ATTR, None)
    if cached is not None:
        return cached
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        t = tensor.detach().to("cpu").contiguous()
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode())
        h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    digest = h.hexdigest()
    setattr(model, _FINGERPRINT_ATTR, digest)
    return digest


def model_overrides(model: Any, *, name: str | None = None, fingerprint: bool = True) -> dict[str, Any]:
    """Config overrides that describe ``model``: ``load_config(path, overrides=model_overrides(model))``.

    ``name`` defaults to the model's path or class; ``revision`` is the weights' fingerprint
    (``fingerprint=False`` leaves it to the YAML, e.g. a release tag, and skips the hashing).
    """
    spec = ModelSpec.of(model)
    out: dict[str, Any] = {
        "name": name or spec.name,
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": spec.dtype,
        "attention": "mha",
        "layers": [k.text for k in spec.layers],
    }
    if fingerprint:
        out["revision"] = model_fingerprint(model)
    return {"model": out}
