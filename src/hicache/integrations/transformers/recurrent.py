"""Recurrent layers of a transformers model (Mamba, gated delta nets, short convolutions): their
state's shapes, and checkpoints of it packed into a page's ``state`` layers and back.

transformers 5 keeps such a layer's state in a ``LinearAttentionLayer`` of the model's cache: a
convolution window (``conv_states``) and, for SSMs and delta nets, a recurrent matrix
(``recurrent_states``), each per state index. Their shapes are read once, by running the model on
two tokens (``probe_states``), and named in the layer's kind (``recurrent:conv0=64x3/float32``), so
the namespace changes with them. A checkpoint is those tensors' bytes, in that order, laid out
over the page's ``state`` layers (``layer_kinds``); the bytes are copied, never converted, so a
restored state is the computed one bit for bit.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ...errors import UnsupportedModelError
from ...layer_kinds import FULL, RECURRENT, LayerKind, LayerKinds, StateTensor, parse_state

__all__ = [
    "RECURRENT_TYPES", "RecordingLayer", "State", "conv_only", "layer_kinds", "pack", "restored_layer", "snapshot",
    "unpack",
]

#: ``layer_types`` of the Hugging Face configs whose layers keep a recurrent state
RECURRENT_TYPES = frozenset({"conv", "linear_attention", "mamba"})
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64"}
_PROBED = "_hicache_state_kinds"

#: One layer's state: its tensors, in ``parse_state`` order (``conv0``, ``rec0``, ``conv1``, ...)
State = tuple[torch.Tensor, ...]


def layer_kinds(model: Any, text: Any, cache_kw: str) -> LayerKinds | None:
    """Each layer's kind, recurrent ones with their state's shapes; ``None`` when no layer is
    recurrent. Runs the model once on two tokens (remembered on the model)."""
    types = [str(t) for t in (getattr(text, "layer_types", None) or [])]
    if not RECURRENT_TYPES & set(types):
        return None
    known = RECURRENT_TYPES | {"full_attention"}
    unknown = sorted(set(types) - known)
    if unknown:
        raise UnsupportedModelError(
            f"{type(model).__name__}: layers of kind {unknown} beside recurrent ones are not supported "
            "(hicache caches recurrent layers beside full-attention ones)"
        )
    cached = getattr(model, _PROBED, None)
    if cached is not None:
        return cached
    states = _probe(model, cache_kw)
    kinds = []
    for i, t in enumerate(types):
        if t == "full_attention":
            kinds.append(LayerKind(FULL))
            continue
        tensors = states.get(i)
        if not tensors:
            raise UnsupportedModelError(f"{type(model).__name__}: layer {i} ({t}) kept no state in the probe")
        kinds.append(LayerKind(RECURRENT, state="+".join(s.text for s in tensors)))
    out = LayerKinds.parse(kinds)
    setattr(model, _PROBED, out)
    return out


def _probe(model: Any, cache_kw: str) -> dict[int, list[StateTensor]]:
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device), **{cache_kw: cache, "use_cache": True})
    out: dict[int, list[StateTensor]] = {}
    for i, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        tensors = []
        for name, t in _named(layer):
            dtype = _DTYPE_NAMES.get(t.dtype)
            if dtype is None:
                raise UnsupportedModelError(f"{type(model).__name__}: layer {i}'s state is {t.dtype}")
            if t.shape[0] != 1:
                raise UnsupportedModelError(f"{type(model).__name__}: layer {i}'s state has batch {t.shape[0]}")
            tensors.append(StateTensor(name, tuple(int(d) for d in t.shape[1:]), dtype))
        out[i] = tensors
    return out


def _named(layer: Any) -> list[tuple[str, torch.Tensor]]:
    """A linear-attention cache layer's state tensors, in checkpoint order."""
    out = []
    for idx in range(layer.number_of_states):
        if layer.is_conv_states_initialized[idx]:
            out.append((f"conv{idx}", layer.conv_states[idx]))
        if layer.is_recurrent_states_initialized[idx]:
            out.append((f"rec{idx}", layer.recurrent_states[idx]))
    return out


def snapshot(cache: Any, layers: tuple[int, ...]) -> dict[int, State]:
    """Copies of the state of ``layers`` in the model's ``cache`` as it is now: a checkpoint."""
    return {i: tuple(t.detach().clone() for _, t in _named(cache.layers[i])) for i in layers}


def pack(state: State, out: torch.Tensor) -> None:
    """Write ``state``'s bytes, in order, into ``out`` (a page's ``state`` layers, any shape and
    dtype, contiguous or not); the bytes after them are zeroed."""
    flat = torch.zeros(out.numel(), dtype=out.dtype, device=out.device)
    raw = flat.view(torch.uint8)
    at = 0
    for t in state:
        b = t.contiguous().view(-1).view(torch.uint8)
        raw[at : at + b.numel()].copy_(b)
        at += b.numel()
    if at > raw.numel():
        raise ValueError(f"a state of {at} bytes does not fit {raw.numel()}")
    out.copy_(flat.view(out.shape))


def unpack(kind: LayerKind, slots: torch.Tensor) -> State:
    """The state of a ``recurrent`` layer from its page's ``state`` layers (``pack``'s inverse)."""
    raw = slots.contiguous().view(-1).view(torch.uint8)
    out = []
    at = 0
    for spec in parse_state(kind.state):
        n = spec.nbytes
        dtype = getattr(torch, spec.dtype)
        out.append(raw[at : at + n].clone().view(dtype).view(1, *spec.shape))
        at += n
    return tuple(out)


def conv_only(kind: LayerKind) -> bool:
    """Whether a recurrent layer's state is convolution windows only (LFM2's short convolutions):
    its checkpoints inside a prefill are read off the forward's own input (``RecordingLayer``)."""
    return [t.name for t in parse_state(kind.state)] == ["conv0"]


class RecordingLayer(LinearAttentionLayer):
    """A convolution-state cache layer that also keeps its state after each token count in
    ``record`` that a multi-token update passes (``recorded``): a convolution's state after token
    ``c`` is its last ``kernel`` inputs up to ``c``, all of which the update sees. So a prefill
    checkpoints conv-only layers in one forward, where an SSM's state would need the forward cut
    there (a forward's fixed cost is tens of ms on the CPU)."""

    def __init__(self, record: list[int], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = record
        self.recorded: dict[int, torch.Tensor] = {}  # token count -> the conv state after it

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs: Any) -> torch.Tensor:
        before = int(self.cumulative_length_linear)  # tokens before this update (one state: index 0)
        prev = self.conv_states[state_idx].clone() if self.has_previous_state[state_idx] else None
        out = super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)
        new = conv_states.shape[-1]
        k = self.conv_kernel_size[state_idx]
        seq = conv_states if prev is None else torch.cat([prev, conv_states], dim=-1)
        first = before - (prev.shape[-1] if prev is not None else 0)  # the token count seq[..., 0] follows
        for c in self.record:
            if before < c <= before + new:
                end = c - first
                window = seq[..., max(0, end - k) : end]
                if window.shape[-1] < k:
                    window = torch.nn.functional.pad(window, (k - window.shape[-1], 0))
                self.recorded[c] = window.clone()
        return out


def restored_layer(state: State, tokens: int, kind: LayerKind, layer: LinearAttentionLayer | None = None) -> LinearAttentionLayer:
    """A model-cache layer that continues from ``state``, the checkpoint after ``tokens`` tokens
    (``layer``: a fresh one to fill, e.g. a ``RecordingLayer``)."""
    if layer is None:
        layer = LinearAttentionLayer(number_of_states=max(1, _states_count(kind)))
    for (name, _), t in zip(_spec_names(kind), state):
        idx = int(name[4:] if name.startswith("conv") else name[3:])
        if name.startswith("conv"):
            layer.lazy_initialization(conv_states=t, state_idx=idx)
            layer.conv_states[idx].copy_(t)
        else:
            layer.lazy_initialization(recurrent_states=t, state_idx=idx)
            layer.recurrent_states[idx].copy_(t)
        layer.has_previous_state[idx] = True
        if layer.device is None:
            layer.dtype, layer.device = t.dtype, t.device
    layer.cumulative_length_linear = torch.tensor(tokens, dtype=torch.long, device=layer.device)
    return layer


def _spec_names(kind: LayerKind) -> list[tuple[str, StateTensor]]:
    return [(s.name, s) for s in parse_state(kind.state)]


def _states_count(kind: LayerKind) -> int:
    idx = [int(s.name[4:] if s.name.startswith("conv") else s.name[3:]) for s in parse_state(kind.state)]
    return max(idx) + 1 if idx else 1
