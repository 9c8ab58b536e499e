"""``PrefixCache``: the model's KV cache, preallocated for the whole sequence and filled in place.

A ``DynamicCache`` concatenates on every step: the restored prefix is copied once into it and
again when the prompt's own KV is appended, and every decode step copies the whole cache. Here
each layer's keys and values live in one buffer sized for the prompt and the expected output
(``KVBuffers``): the restored prefix is copied once, straight from the cache's device pages into
its place, and each step writes only its new tokens. The model attends over views of the filled
part. A sequence that outgrows its buffer moves that layer to a larger one (doubling).

The restored prefix reaches the model in one of two ways:

* ``prefix`` (segment mode, ``attend_in_pages``): not copied at all. Layer ``i`` gets views of the cache's
  device pages the first time the forward writes layer ``i``, and ``update`` returns ``Segments``
  (those views and the buffer's own tokens) for ``segment_attention`` (``attention.py``).
* ``restore`` (copy mode): layer ``i``'s prefix is copied into the buffer the first time the
  forward writes layer ``i``, and ``update`` returns the buffer's filled part, for any attention.

Either way, while layer ``i`` computes, the load-back keeps bringing layers ``i+1..``. Every layer
reports the restored length from the start: the model reads it (positions) before layer 0 runs.
Buffer positions are token positions: the sequence's own tokens sit at their index, also in
segment mode, where the buffer's first ``restored`` slots stay unused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .attention import Segments

__all__ = ["KVBuffers", "BufferPool", "PrefixCache", "layer_tensors"]

#: ``restore(layer, kv)`` fills ``kv[:, 0, :, :n]``: one layer's keys and values, ``[2, 1, H, capacity, D]``
#: (both in one tensor, so a run of pages is copied in one call: 15-40% faster than two here)
RestoreLayer = Callable[[int, torch.Tensor], None]
#: ``prefix(layer)``: the views ``[(k, v)]`` (each ``[1, H, n_i, D]``) holding one layer's prefix, in order
PrefixViews = Callable[[int], list[tuple[torch.Tensor, torch.Tensor]]]

_ROUND = 128  # buffer capacities are rounded up to this many tokens, so buffers are reusable


class KVBuffers:
    """Keys and values of every layer, ``[2, L, 1, H, capacity, D]`` in one allocation."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.capacity = capacity
        self.data = torch.empty((2, num_layers, 1, num_kv_heads, capacity, head_dim), dtype=dtype, device=device)

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[0, layer]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[1, layer]

    def layer(self, layer: int) -> torch.Tensor:
        """Keys and values of ``layer`` in one view, ``[2, 1, H, capacity, D]``."""
        return self.data[:, layer]


class BufferPool:
    """Reuses ``KVBuffers`` between sequences: a fresh multi-MB tensor costs page faults on first
    touch on every request, a reused one does not. Keeps at most ``keep`` idle buffers."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 *, keep: int = 4) -> None:
        self._shape = (num_layers, num_kv_heads, head_dim)
        self._dtype = dtype
        self._device = device
        self._keep = keep
        self._idle: list[KVBuffers] = []

    def take(self, tokens: int) -> KVBuffers:
        """A buffer for at least ``tokens`` tokens (the smallest idle one that fits, else a new one)."""
        fits = [b for b in self._idle if b.capacity >= tokens]
        if fits:
            best = min(fits, key=lambda b: b.capacity)
            self._idle.remove(best)
            return best
        capacity = -(-max(tokens, 1) // _ROUND) * _ROUND
        return KVBuffers(*self._shape, capacity, self._dtype, self._device)

    def give_back(self, buffers: KVBuffers) -> None:
        self._idle.append(buffers)
        if len(self._idle) > self._keep:
            self._idle.remove(min(self._idle, key=lambda b: b.capacity))


class _Layer(DynamicLayer):
    """One layer of a ``PrefixCache``: its buffer, and its prefix (copied in, or views elsewhere)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, *, restore: Callable[[], None] | None,
                 prefix: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]] | None, segments: bool):
        super().__init__()
        self._k, self._v = keys, values
        self._len = length
        self._restore = restore
        self._prefix = prefix
        self._views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        self._own = length if prefix is not None else 0  # where the buffer's own tokens start
        self._segments = segments
        self.device = keys.device
        self.is_initialized = True

    # The filled part of the buffer, as views made when asked for (not on every step).
    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor:
        return self._k[:, :, : self._len]

    @keys.setter
    def keys(self, value: Any) -> None:
        _views_only(value)

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor:
        return self._v[:, :, : self._len]

    @values.setter
    def values(self, value: Any) -> None:
        _views_only(value)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None  # the buffer exists from the start

    def restore(self) -> None:
        """Put the prefix in place now: copy it in, or fetch its views (idempotent)."""
        if self._restore is not None:
            fill, self._restore = self._restore, None
            fill()
        if self._prefix is not None:
            fetch, self._prefix = self._prefix, None
            self._views = tuple(fetch())

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self._restore is not None or self._prefix is not None:
            self.restore()
        start = self._len
        end = start + key_states.shape[-2]
        if end > self._k.shape[-2]:
            self._grow(end)
        k, v = self._k, self._v
        k[:, :, start:end].copy_(key_states)
        v[:, :, start:end].copy_(value_states)
        self._len = end
        if self._segments:
            own = self._own
            return (Segments(self._views, k[:, :, own:end], v[:, :, own:end], end - start),) * 2
        return k[:, :, :end], v[:, :, :end]

    def _grow(self, tokens: int) -> None:
        capacity = max(tokens, 2 * self._k.shape[-2])
        for name in ("_k", "_v"):
            old = getattr(self, name)
            new = old.new_empty((*old.shape[:-2], capacity, old.shape[-1]))
            new[:, :, : self._len].copy_(old[:, :, : self._len])
            setattr(self, name, new)

    def get_seq_length(self) -> int:
        return self._len

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        self._len = max(0, self._len + tokens_to_remove)

    def reset(self) -> None:
        self._len = self._own = 0
        self._restore = self._prefix = None
        self._views = ()

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("PrefixCache holds one sequence")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("PrefixCache holds one sequence")


class PrefixCache(DynamicCache):
    """A ``DynamicCache`` over preallocated buffers whose first ``restored`` tokens come from elsewhere.

    ``restore(layer, kv)`` copies a layer's prefix into the buffer; ``prefix(layer)`` returns
    views of it instead (segment mode only). ``segments``: ``update`` returns ``Segments`` for
    ``segment_attention`` rather than tensors. With ``lazy=False`` every layer's prefix is put in
    place before the forward starts. ``config`` (the model's) is not read: the layers are all this
    module's full-attention buffers (sliding-window models attend over them with their own masks),
    except the layers in ``linear``: a recurrent layer's cache layer (``recurrent.py``), fresh or
    continuing from a checkpoint. ``fill_linear(i, layer)`` puts layer ``i``'s checkpoint in ``layer``: it runs
    when the forward first reads or writes that layer's state (lazily, like ``restore``), so the
    wait for a state's load-back overlaps the layers before it.
    """

    def __init__(self, config: Any, buffers: KVBuffers, num_layers: int, *, restored: int = 0,
                 restore: RestoreLayer | None = None, prefix: PrefixViews | None = None,
                 segments: bool = False, lazy: bool = True, linear: Mapping[int, Any] | None = None,
                 fill_linear: Callable[[int, Any], None] | None = None) -> None:
        super().__init__()  # not DynamicCache(config=): it builds layers we replace, and costs 1 ms a prefill
        if restore is not None and prefix is not None:
            raise ValueError("give restore (copy the prefix in) or prefix (views of it), not both")
        if prefix is not None and not segments:
            raise ValueError("prefix views need segment mode: only segment_attention reads them")
        self.buffers = buffers
        if restored > buffers.capacity:
            raise ValueError(f"{restored} restored tokens do not fit a buffer of {buffers.capacity}")
        if not (restore or prefix):
            restored = 0
        layers: list[Any] = []
        for i in range(num_layers):
            if linear is not None and i in linear:
                layers.append(linear[i])
                continue
            k, v = buffers.keys(i), buffers.values(i)
            fill = (lambda i=i: restore(i, buffers.layer(i))) if restore is not None and restored else None
            views = (lambda i=i: prefix(i)) if prefix is not None and restored else None
            layers.append(_Layer(k, v, restored, restore=fill, prefix=views, segments=segments))
        self.layers = layers
        if hasattr(self, "layer_class_to_replicate"):
            self.layer_class_to_replicate = None
        self._fill_linear = fill_linear
        self._unfilled = set(linear or ()) if fill_linear is not None else set()
        if not lazy:
            self.restore_all()

    def restore_all(self) -> None:
        for layer in self.layers:
            if isinstance(layer, _Layer):
                layer.restore()
        for i in sorted(self._unfilled):
            self._filled(i)

    def _filled(self, layer_idx: int | None) -> None:
        """Put recurrent layer ``layer_idx``'s checkpoint in place if it is not yet (``None``: all)."""
        if not self._unfilled:
            return
        todo = sorted(self._unfilled) if layer_idx is None else [layer_idx] if layer_idx in self._unfilled else []
        for i in todo:
            self._unfilled.discard(i)
            assert self._fill_linear is not None
            self._fill_linear(i, self.layers[i])

    def get_conv_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._filled(layer_idx)
        return super().get_conv_state(layer_idx, *args, **kwargs)

    def get_recurrent_state(self, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._filled(layer_idx)
        return super().get_recurrent_state(layer_idx, *args, **kwargs)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._filled(layer_idx)
        return super().update_conv_state(conv_states, layer_idx, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._filled(layer_idx)
        return super().update_recurrent_state(recurrent_states, layer_idx, *args, **kwargs)

    def increase_count(self, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        self._filled(layer_idx)
        return super().increase_count(layer_idx, *args, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, *args: Any, **kwargs: Any) -> bool:
        self._filled(layer_idx)
        return super().has_previous_state(layer_idx, *args, **kwargs)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        return self.layers[layer_idx].update(key_states, value_states)


def _views_only(value: Any) -> None:
    if value is not None:  # None: the base class's initial state
        raise AttributeError("a PrefixCache layer's keys and values are views of its buffer; update() writes them")


def layer_tensors(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, seq, head_dim]`` of one layer, across transformers versions."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56
