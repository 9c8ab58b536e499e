"""Reading a whole view back and comparing it with the KV that was stored."""

from __future__ import annotations

import torch

from hicache.leases import RetrieveView


async def assert_view_equals(view: RetrieveView, kv: torch.Tensor) -> None:
    """Every layer of ``view`` equals ``kv[:, layer, :view.tokens]``, bit for bit."""
    n = view.tokens
    for layer in range(kv.shape[1]):
        await view.wait_layer(layer)
        for c, part in enumerate(view.layer(layer)):
            assert torch.equal(part, kv[c, layer, :n]), f"layer {layer} component {c}: wrong KV"
