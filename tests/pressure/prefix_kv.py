"""KV that is a pure function of the token prefix: two prompts sharing a prefix have the same KV on
it, so a page served from the wrong node, or a stale one, is caught bit for bit."""

from __future__ import annotations

import torch

from .conftest import GEOMETRY

_C, _L, _H, _D = 2, GEOMETRY["num_layers"], GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"]
_OFFSETS = torch.arange(_C * _L * _H * _D, dtype=torch.float64).reshape(_C, _L, 1, _H, _D)


def prefix_kv(tokens: list[int]) -> torch.Tensor:
    """``[2, L, T, H, D]`` float32; every value below 2**24, so exact."""
    h, hashes = 7, []
    for tok in tokens:
        h = (h * 31 + tok + 1) % 65521
        hashes.append(h)
    base = torch.tensor(hashes, dtype=torch.float64).reshape(1, 1, len(tokens), 1, 1) * 256
    return (base + _OFFSETS).to(torch.float32)
