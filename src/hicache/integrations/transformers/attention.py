"""Attention over KV in pieces: the cached prefix where it lies, the sequence's own tokens in its buffer.

On the CPU ``CachedCausalLM`` attends with ``segment_attention``: torch's flash kernel for the CPU,
which also returns the log-sum-exp of each query's scores. Usually there is one piece, the
sequence's buffer with the restored prefix copied in. With ``attend_in_pages=True`` the prefix is
not copied: ``PrefixCache`` hands the attention *views* of the cache's device pages (one per run
of consecutive pages) besides the buffer, and the pieces are merged exactly (the rescaling of
flash-decoding): ``out = sum_i exp(lse_i - lse) out_i``. That saves the copy but costs a call and a
merge per piece in every step; ``benchmarks/prefix_attention.py`` measures which wins.

Grouped-query attention needs no copies of K and V: the query heads that share a KV head
are stacked along the query axis (``[B, Hkv, g * T, D]``), against the ``repeat_kv`` copies of
transformers' SDPA path. Only the sequence's own piece needs a mask (causal, offset by the tokens
computed before this step); a piece of the prefix is seen whole by every query.

Registered with transformers as ``"hicache_segments"``; ``CachedCausalLM`` switches the model to it
for its own forwards only (and back). The model builds no mask for it (transformers skips mask
creation for attention functions without one). Used on the CPU; elsewhere the prefix is copied
into the buffer and the model's own attention runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ATTENTION", "Segments", "available", "segment_attention", "using_segments"]

ATTENTION = "hicache_segments"

_flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_registered = False


@dataclass(frozen=True)
class Segments:
    """One layer's keys and values for one step, in pieces (batch 1).

    ``prefix``: ``(k, v)`` views ``[1, Hkv, n_i, D]`` every query sees whole. ``own_k``/``own_v``:
    ``[1, Hkv, L, D]``, the sequence's own tokens, whose last ``queries`` are this step's.
    """

    prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    own_k: torch.Tensor
    own_v: torch.Tensor
    queries: int

    @property
    def shape(self) -> torch.Size:  # what some model code reads off the keys
        length = self.own_k.shape[-2] + sum(k.shape[-2] for k, _ in self.prefix)
        return torch.Size((*self.own_k.shape[:-2], length, self.own_k.shape[-1]))


def available(device: torch.device) -> bool:
    """Segment attention runs here (the CPU, with the flash kernel of this torch build)."""
    return device.type == "cpu" and _flash is not None and _register()


def _register() -> bool:
    global _registered
    if not _registered:
        try:
            from transformers import AttentionInterface
        except ImportError:  # transformers too old for custom attention functions
            return False
        AttentionInterface.register(ATTENTION, segment_attention)
        _registered = True
    return True


@contextmanager
def using_segments(model: Any) -> Iterator[None]:
    """The model attends with ``segment_attention`` inside the block (one forward at a time)."""
    configs = {id(c): c for c in (model.config, _text_config(model.config))}.values()
    saved = [(c, c._attn_implementation) for c in configs]
    for c, _ in saved:
        c._attn_implementation = ATTENTION
    try:
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


def _text_config(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


_masks: dict[tuple[int, int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _own_mask(queries: int, length: int, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Additive mask ``[groups * queries, length]``: query ``j`` sees own tokens up to ``length - queries + j``."""
    if queries == 1:
        return None
    key = (queries, length, groups, dtype, device)
    mask = _masks.get(key)
    if mask is None:
        if len(_masks) > 64:
            _masks.clear()
        one = torch.full((queries, length), float("-inf"), dtype=dtype, device=device).triu(length - queries + 1)
        mask = _masks[key] = one.repeat(groups, 1)
    return mask


def segment_attention(
    module: Any,
    query: torch.Tensor,
    key: Segments,
    value: Segments,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over ``Segments``: returns ``[B, T, Hq, D]`` and no weights."""
    if not isinstance(key, Segments):
        raise TypeError("segment_attention needs a PrefixCache in segment mode (CachedCausalLM sets it up)")
    if dropout or kwargs.get("softcap") or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None:
        raise NotImplementedError("segment_attention: dropout, soft-capping, sliding windows and sinks are not supported")
    batch, heads, queries, dim = query.shape
    kv_heads = key.own_k.shape[1]
    groups = heads // kv_heads
    q = query.reshape(batch, kv_heads, groups * queries, dim)  # query heads sharing a KV head, stacked
    mask = _own_mask(queries, key.own_k.shape[-2], groups, q.dtype, q.device)
    pieces = [(k, v, None) for k, v in key.prefix] + [(key.own_k, key.own_v, mask)]
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for k, v, m in pieces:
        if k.shape[-2] == 0:
            continue
        o, l = _flash(q, k, v, 0.0, False, attn_mask=m, scale=scaling)
        if out is None:
            out, lse = o, l
            continue
        assert lse is not None
        top = torch.maximum(lse, l)
        a, b = torch.exp(lse - top), torch.exp(l - top)
        total = a + b
        out = (out * (a / total).unsqueeze(-1)).add_(o * (b / total).unsqueeze(-1))
        lse = top + torch.log(total)
    assert out is not None
    out = out.reshape(batch, heads, queries, dim)
    return out.transpose(1, 2).contiguous(), None
