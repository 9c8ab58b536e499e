"""Attention over KV in pieces: the cached prefix where it lies, the sequence's own tokens in its buffer.

On the CPU ``CachedCausalLM`` attends with ``segment_attention``. Usually there is one piece, the
sequence's buffer with the restored prefix copied in. With ``attend_in_pages=True`` the prefix is
not copied: ``PrefixCache`` hands the attention *views* of the cache's device pages (one per run
of consecutive pages) besides the buffer.

A prefill step attends in two parts, merged exactly (the rescaling of flash-decoding,
``out = sum_i exp(lse_i - lse) out_i``): the keys every query sees whole (the prefix, and own
tokens computed before this step), without a mask, and this step's own tokens with torch's
*causal* flash kernel, which skips the blocks above the diagonal instead of masking them. With no
prefix (a cold prefill) that one causal call is all: the very call the model's own SDPA attention
makes. Every call shares K and V heads natively (grouped-query attention, no ``repeat_kv`` copies).
A step of fewer than ``SPLIT_MIN_QUERIES`` tokens over a buffer holding more (a short turn after
a prefix copied in) takes one call with a mask instead: its triangle is too small to pay for a
second call and a merge. Earlier versions stacked the query heads of a KV head and so needed a mask
for every prefill; computing every block, a cold prefill cost 1.1-1.6x the model's own forward
at 1-6K tokens (``benchmarks/prefill_overhead.py`` compares the two).

A decode step's single query sees every piece whole: the query heads sharing a KV head are stacked
(``[B, Hkv, g, D]``), so each KV head is read once (as transformers 5's SDPA does).

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
    queries = query.shape[-2]
    if queries == 1:
        out = _decode(query, key, scaling)
    else:
        out = _prefill(query, key, scaling)
    return out.transpose(1, 2).contiguous(), None


#: below this many queries a prefill step after computed tokens takes one call with a mask: the
#: triangle the causal kernel skips is then smaller than what a second call and a merge cost
SPLIT_MIN_QUERIES = 128

_masks: dict[tuple[int, int, torch.dtype, torch.device], torch.Tensor] = {}


def _prefill(query: torch.Tensor, key: Segments, scaling: float | None) -> torch.Tensor:
    """Several queries: the pieces every query sees whole (the prefix, and the own tokens computed
    before this step) without a mask, this step's own tokens with the causal kernel, merged.

    The causal kernel is top-left aligned, so it takes exactly this step's keys (a square). With
    nothing before them (a cold prefill) that one call is all, the model's own: SDPA, causal, GQA.
    A short step over a buffer holding more (the prefix copied in) takes one call with a mask."""
    queries = query.shape[-2]
    own = key.own_k.shape[-2]
    done = own - queries  # own tokens computed before this step
    seen = [(k, v) for k, v in key.prefix if k.shape[-2]]
    if not seen and done == 0:
        return torch.nn.functional.scaled_dot_product_attention(
            query, key.own_k, key.own_v, is_causal=True, scale=scaling, enable_gqa=True
        )
    if not seen and queries < SPLIT_MIN_QUERIES:
        mask = _causal_mask(queries, own, query.dtype, query.device)
        return _flash(query, key.own_k, key.own_v, 0.0, False, attn_mask=mask, scale=scaling)[0]
    if done:
        seen.append((key.own_k[:, :, :done], key.own_v[:, :, :done]))
    # K and V heads are shared natively (grouped-query attention) by every call
    out, lse = _flash(query, key.own_k[:, :, done:], key.own_v[:, :, done:], 0.0, True, scale=scaling)
    for i, (k, v) in enumerate(seen):
        o, l = _flash(query, k, v, 0.0, False, scale=scaling)
        out, lse = _merge(out, lse, o, l, last=i == len(seen) - 1)
    return out


def _causal_mask(queries: int, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[queries, length]``: query ``j`` sees keys up to ``length - queries + j``. Made
    once per forward (its layers share it); the last few are kept (each under 4 MB at 8K keys)."""
    key = (queries, length, dtype, device)
    mask = _masks.get(key)
    if mask is None:
        if len(_masks) >= 4:
            _masks.clear()
        mask = _masks[key] = torch.full((queries, length), float("-inf"), dtype=dtype, device=device).triu(
            length - queries + 1
        )
    return mask


def _decode(query: torch.Tensor, key: Segments, scaling: float | None) -> torch.Tensor:
    """One query sees every piece whole. The query heads sharing a KV head are stacked
    (``[B, Hkv, g, D]``), so each KV head is read once, not once per query head."""
    batch, heads, _, dim = query.shape
    kv_heads = key.own_k.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    pieces = [(k, v) for k, v in key.prefix if k.shape[-2]]
    if key.own_k.shape[-2]:
        pieces.append((key.own_k, key.own_v))
    if len(pieces) == 1:
        (k, v), = pieces
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scaling)
    else:
        out, lse = _flash(q, *pieces[0], 0.0, False, scale=scaling)
        for i, (k, v) in enumerate(pieces[1:], 2):
            o, l = _flash(q, k, v, 0.0, False, scale=scaling)
            out, lse = _merge(out, lse, o, l, last=i == len(pieces))
    return out.reshape(batch, heads, 1, dim)


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor, *,
           last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attentions of the same queries over disjoint keys, as one: ``out`` moves towards ``o``
    by ``o``'s share of the softmax mass, ``exp(l) / (exp(lse) + exp(l)) = sigmoid(l - lse)``.
    The merged log-sum-exp is only needed if another piece follows (not ``last``)."""
    share = torch.sigmoid(l - lse).unsqueeze(-1).to(out.dtype)
    return torch.lerp(out, o, share), (lse if last else torch.logaddexp(lse, l))
