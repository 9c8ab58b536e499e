"""A ``DynamicCache`` that receives the restored prefix layer by layer, as the forward reaches it.

Layer ``i``'s prefix is fetched (and, if still loading, waited for) the first time the model
writes layer ``i``: while layer ``i`` computes, layers ``i+1..`` keep arriving from the host.
Layer 0 is restored before the forward starts, since the model reads the cached length from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

__all__ = ["RestoringCache", "layer_tensors"]

FetchLayer = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


class RestoringCache(DynamicCache):
    """``DynamicCache`` whose layers start with a restored prefix, fetched lazily per layer."""

    def __init__(self, config: Any, fetch: FetchLayer | None, num_layers: int, *, lazy: bool) -> None:
        try:
            super().__init__(config=config)
        except TypeError:  # transformers before 4.56 had no config argument
            super().__init__()
        self._fetch = fetch
        self._pending = set(range(num_layers)) if fetch is not None else set()
        if self._pending:
            self.restore(0)
            if not lazy:
                for layer in range(1, num_layers):
                    self.restore(layer)

    def restore(self, layer: int) -> None:
        """Put layer ``layer``'s prefix in place now (idempotent)."""
        if layer in self._pending:
            self._pending.discard(layer)
            assert self._fetch is not None
            k, v = self._fetch(layer)
            super().update(k, v, layer)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        if layer_idx in self._pending:
            self.restore(layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def layer_tensors(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[batch, kv_heads, seq, head_dim]`` of one layer, across transformers versions."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return layers[layer].keys, layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56
