"""SGLang's host KV pool as hicache page buffers: each page's own memory, lent to the storage tiers.

SGLang's host pools (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) keep one ``kv_buffer``
tensor whose shape depends on ``--hicache-mem-layout``. A page is a handful of contiguous regions
of it, the same ones ``get_page_buffer_meta`` names to SGLang's zero-copy backends:

==================  ===============================  ==============================  ==================
layout              MHA ``kv_buffer``                 MLA ``kv_buffer``                pieces a page
==================  ===============================  ==============================  ==================
layer_first         ``[2, L, tokens, H, D]``          ``[L, tokens, 1, D]``           2L (MHA), L (MLA)
page_first          ``[2, tokens, L, H, D]``          ``[tokens, L, 1, D]``           2 (MHA), 1 (MLA)
page_first_direct   ``[2, pages, L, page, H, D]``     ``[pages, L, page, 1, D]``      2 (MHA), 1 (MLA)
page_head           ``[2, pages, H, page, L, D]``     (none)                          2
==================  ===============================  ==============================  ==================

``HostPages`` views the buffer as ``[pages, pieces, piece_bytes]`` (a numpy view, no copy), so a
storage tier reads a page straight into the pool (``preadv``) and writes it straight from it.

The bytes of a page, its pieces in order, are SGLang's flat page (``get_data_page(flat=True)``), so
the zero-copy and the copy paths store the same bytes. Their order is not always hicache's canonical
``[C, L, page, H, D]``: ``page_first`` pages are token-major ``[C, page, L, H, D]`` and ``page_head``
pages head-major. ``PAGE_ORDERS`` names each layout's order; the order is part of the namespace (see
``settings.py``), so a page is only ever read back into a pool that lays it out the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedModelError

__all__ = ["FlatPages", "HostPages", "PAGE_ORDERS", "pages_of"]

#: (attention, layout) -> the order of a page's bytes (``layer-major`` is hicache's canonical one).
PAGE_ORDERS = {
    ("mha", "layer_first"): "layer-major",
    ("mha", "page_first_direct"): "layer-major",
    ("mha", "page_first"): "token-major",
    ("mha", "page_head"): "head-major",
    ("mla", "layer_first"): "layer-major",
    ("mla", "page_first_direct"): "layer-major",
    ("mla", "page_first"): "token-major",
}


class HostPages:
    """A ``StorageTier`` page source over an SGLang host pool (see the module docstring)."""

    def __init__(self, pool: Any, *, attention: str) -> None:
        layout = getattr(pool, "layout", None)
        if (attention, layout) not in PAGE_ORDERS:
            known = sorted({lay for att, lay in PAGE_ORDERS if att == attention})
            raise UnsupportedModelError(
                f"SGLang host layout {layout!r} ({attention.upper()}) is not supported by hicache's backend "
                f"(supported: {', '.join(known)}; set --hicache-mem-layout)"
            )
        buffer = pool.kv_buffer
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise UnsupportedModelError(
                f"{type(pool).__name__}: kv_buffer is not one contiguous host tensor; hicache's backend reads and "
                "writes pages in place and needs one"
            )
        self.pool = pool
        self.layout = layout
        self.order = PAGE_ORDERS[(attention, layout)]
        self.page_size = int(pool.page_size)
        self.num_pages = int(pool.size) // self.page_size
        # Dimensions in front of the token (or page) axis are the pieces of a page, in order.
        outer = {"layer_first": 2 * pool.layer_num if attention == "mha" else pool.layer_num}.get(
            layout, 2 if attention == "mha" else 1
        )
        raw = buffer.view(torch.uint8).numpy()  # no copy; ``self.buffer`` keeps the memory alive
        self.buffer = buffer
        self._pieces = raw.reshape(outer, self.num_pages, -1).transpose(1, 0, 2)
        self.page_bytes = outer * self._pieces.shape[2]

    def page_pieces(self) -> np.ndarray:
        """``[pages, pieces, piece_bytes]``: page ``p``'s regions of the pool, in order."""
        return self._pieces

    def piece_addresses(self, page: int) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each piece of ``page``: what ``get_page_buffer_meta`` reports."""
        return [(piece.ctypes.data, piece.nbytes) for piece in self._pieces[page]]


def pages_of(host_indices: torch.Tensor, page_size: int, num_keys: int) -> list[int] | None:
    """The host pages that ``host_indices`` (token slots, ``num_keys * page_size`` of them) cover, in
    order; ``None`` unless they are whole pages (each ``page_size`` consecutive slots from a page start)."""
    if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1:
        return None
    if host_indices.numel() != num_keys * page_size:
        return None
    if num_keys == 0:
        return []
    slots = host_indices.to("cpu", torch.int64).view(num_keys, page_size)
    starts = slots[:, 0]
    if bool((starts % page_size).any()) or bool((starts < 0).any()):
        return None
    if page_size > 1 and not torch.equal(slots - starts[:, None], torch.arange(page_size).expand(num_keys, -1)):
        return None
    return (starts // page_size).tolist()


class FlatPages:
    """A page source over loose flat pages (SGLang's copy path: ``batch_get`` / ``batch_set``)."""

    def __init__(self, tensors: Sequence[torch.Tensor], page_bytes: int) -> None:
        self._pieces: list[tuple[memoryview]] = []
        self.tensors: list[torch.Tensor] = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.nbytes != page_bytes:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"a flat page is a CPU tensor of {page_bytes} bytes, got {got}")
            t = t if t.is_contiguous() else t.contiguous()
            self.tensors.append(t)
            self._pieces.append((memoryview(t.view(-1).view(torch.uint8).numpy()),))

    def page_pieces(self) -> list[tuple[memoryview]]:
        return self._pieces
