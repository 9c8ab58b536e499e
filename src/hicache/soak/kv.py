"""Synthetic KV that is a pure function of the token prefix, exact in every supported dtype.

Two prompts sharing a prefix get the same KV on it, so a page served under the wrong prefix, stale
or corrupted, differs from what is expected bit for bit. Values are small integers (|v| <= 125),
exact in float32, float16, bfloat16 and float64.
"""

from __future__ import annotations

import torch

from ..tiers.base import KVGeometry

__all__ = ["PrefixKV"]


class PrefixKV:
    def __init__(self, geometry: KVGeometry) -> None:
        g = geometry
        self.geometry = g
        shape = (g.components, g.num_layers, 1, g.num_kv_heads, g.head_dim)
        self._offsets = torch.arange(int(torch.tensor(shape).prod()), dtype=torch.int64).reshape(shape) * 7

    @staticmethod
    def _hashes(tokens: list[int]) -> torch.Tensor:
        h, out = 7, []
        for tok in tokens:
            h = (h * 31 + tok + 1) % 65521
            out.append(h)
        return torch.tensor(out, dtype=torch.int64)

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        """``[C, L, len(tokens), H, D]`` in the geometry's dtype."""
        h = self._hashes(tokens).reshape(1, 1, -1, 1, 1)
        return ((h * 131 + self._offsets) % 251 - 125).to(self.geometry.dtype)
