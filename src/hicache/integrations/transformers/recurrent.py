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

import sys
import threading
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin, LinearAttentionLayer

from ...dtype_names import DTYPE_NAMES
from ...errors import UnsupportedModelError
from ...layer_kinds import FULL, RECURRENT, LayerKind, LayerKinds, StateTensor, parse_state

__all__ = [
    "RECURRENT_TYPES", "RecordingLayer", "State", "conv_only", "layer_kinds", "pack", "record_delta_rules",
    "restored_layer", "snapshot", "unpack",
]

#: ``layer_types`` of the Hugging Face configs whose layers keep a recurrent state
RECURRENT_TYPES = frozenset({"conv", "linear_attention", "mamba"})
_PROBED = "_hicache_state_kinds"
_CHUNK_RULE = "torch_chunk_gated_delta_rule"  # the name a gated delta net's forward calls its chunked rule by
_ARMED = threading.local()  # the RecordingLayer whose layer's forward is running: (layer, tokens before, new tokens)

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
            dtype = DTYPE_NAMES.get(t.dtype)
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
    """A recurrent layer's cache layer that also keeps its state after each token count in
    ``record`` that a multi-token forward passes (``take``), so a prefill checkpoints in one
    forward where a cut forward would cost its fixed overhead (tens of ms on the CPU) per cut.

    A convolution's state after token ``c`` is its last ``kernel`` inputs up to ``c``, all of which
    the update sees. A gated delta net's recurrent state (``delta_rule``) is taken by its chunked
    rule, which ``record_delta_rules`` makes run in segments split at those counts: the update arms
    it just before the layer's forward calls it."""

    def __init__(self, record: list[int], delta_rule: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.record = record
        self.delta_rule = delta_rule
        self.recorded: dict[int, torch.Tensor] = {}  # token count -> the conv state after it
        self.recorded_states: dict[int, torch.Tensor] = {}  # token count -> the recurrent state after it

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs: Any) -> torch.Tensor:
        before = int(self.cumulative_length_linear)  # tokens before this update (one state: index 0)
        prev = self.conv_states[state_idx].clone() if self.has_previous_state[state_idx] else None
        out = super().update_conv_state(conv_states, state_idx, conv_kernel_size=conv_kernel_size, **kwargs)
        new = conv_states.shape[-1]
        k = self.conv_kernel_size[state_idx]
        seq = conv_states if prev is None else torch.cat([prev, conv_states], dim=-1)
        first = before - (prev.shape[-1] if prev is not None else 0)  # the token count seq[..., 0] follows
        due = [c for c in self.record if before < c <= before + new]
        for c in due:
            end = c - first
            window = seq[..., max(0, end - k) : end]
            if window.shape[-1] < k:
                window = torch.nn.functional.pad(window, (k - window.shape[-1], 0))
            self.recorded[c] = window.clone()
        _ARMED.layer = (self, before, new) if self.delta_rule and due else None
        return out

    def take(self, tokens: int) -> State:
        """The checkpoint after ``tokens`` (a count in ``record`` that a forward passed), in
        ``parse_state`` order, each tensor in the dtype this layer keeps it in."""
        conv = self.recorded.pop(tokens)
        if not self.delta_rule:
            return (conv,)
        rec = self.recorded_states.pop(tokens)
        return conv, rec.to(self.recurrent_states[0].dtype)


def record_delta_rules(model: Any) -> frozenset[int]:
    """The layers of ``model`` whose gated delta net can checkpoint inside one forward
    (``RecordingLayer(delta_rule=True)``): each such family's module-level chunked rule is wrapped,
    once per process, so that a forward armed by a ``RecordingLayer`` runs it in segments ending at
    the due counts. Unarmed calls (any other cache, any other model) run the rule unchanged."""
    out = set()
    for mod in model.modules():
        owner = sys.modules.get(type(mod).__module__)
        rule = getattr(owner, _CHUNK_RULE, None)
        idx = getattr(mod, "layer_idx", None)
        if rule is None or idx is None or not type(mod).__name__.endswith("GatedDeltaNet"):
            continue
        if not getattr(rule, "_hicache_records", False):
            setattr(owner, _CHUNK_RULE, _recording_rule(rule))
        out.add(int(idx))
    return frozenset(out)


def _recording_rule(rule: Any) -> Any:
    def recording(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        armed, _ARMED.layer = getattr(_ARMED, "layer", None), None
        tokens = query.shape[1]
        if armed is None or args or armed[2] != tokens:
            return rule(query, key, value, *args, **kwargs)
        layer, before, _ = armed
        cuts = [c - before for c in layer.record if before < c <= before + tokens]
        if cuts[-1] != tokens:
            cuts.append(tokens)
        g, beta = kwargs.pop("g"), kwargs.pop("beta")
        state = kwargs.pop("initial_state", None)
        final = kwargs.pop("output_final_state", False)
        outs, at = [], 0
        for cut in cuts:
            part = slice(at, cut)
            out, state = rule(query[:, part], key[:, part], value[:, part], g=g[:, part], beta=beta[:, part],
                              initial_state=state, output_final_state=True, **kwargs)
            if before + cut in layer.record:
                layer.recorded_states[before + cut] = state.clone()
            outs.append(out)
            at = cut
        return torch.cat(outs, dim=1), state if final else None

    recording._hicache_records = True  # type: ignore[attr-defined]
    return recording


def restored_layer(
    state: State, tokens: int, kind: LayerKind, layer: LinearAttentionLayer | None = None
) -> LinearAttentionLayer:
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
