"""``int8``: 8-bit KV with KIVI-style scales, K per channel and V per token (lossy, opt-in).

A page ``[C, L, page_size, H, D]`` is stored as int8 values and fp16 scales, symmetric
(``q = round(x / scale)``, ``|q| <= 127``):

* K (component 0 of MHA): one scale per (layer, head, channel), over the page's tokens: keys have
  outlier channels, and a scale per channel keeps the others' precision;
* V (and an MLA latent): one scale per (layer, token, head), over the head dimension.

Chosen over fp8 e4m3 by ``benchmarks/page_codecs.py`` on SmolLM2's KV (docs/codecs.md): 0.45% relative
error against 2.6%, and a 5x smaller first-token logit difference, for 1.94x fewer bytes on bf16 KV
(3.88x on fp32) against fp8's 2x (4x). Non-finite KV values are not preserved. Pages written with
this stage live in another namespace (``PageCodec``): an exact reader never gets one.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import numpy as np
import torch

from ...base import KVGeometry
from .base import Codec, CodecError, PageContext

__all__ = ["Int8"]

_FP16_MAX = 65504.0


class Int8(Codec):
    name: ClassVar[str] = "int8"
    id: ClassVar[int] = 1
    role = "lossy"

    def __init__(self, geometry: KVGeometry) -> None:
        if not geometry.dtype.is_floating_point or geometry.dtype.itemsize < 2:
            raise ValueError(f"int8 quantises fp16, bf16, fp32 or fp64 KV, not {geometry.dtype}")
        self.geometry = geometry
        self._scratch = threading.local()
        g = geometry
        self._values = g.components * g.num_layers * g.page_size * g.num_kv_heads * g.head_dim
        per_channel = g.num_layers * g.num_kv_heads * g.head_dim if g.components == 2 else 0
        per_token = g.num_layers * g.page_size * g.num_kv_heads * (g.components - (1 if g.components == 2 else 0))
        self._scales = per_channel + per_token
        self._stored = self._values + 2 * self._scales

    def encoded_bytes(self, n: int) -> int | None:
        return self._stored

    def max_encoded_bytes(self, n: int) -> int:
        return self._stored

    def _view(self, buf: memoryview) -> torch.Tensor:
        g = self.geometry
        if buf.readonly:  # torch only wraps writable memory (bytes read back whole, e.g. by inspect)
            buf = memoryview(bytearray(buf))
        return torch.frombuffer(buf, dtype=g.dtype).view(
            g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim
        )

    def _as_fp32(self, data: memoryview) -> torch.Tensor:
        """The page as fp32 ``[C, L, P, H, D]``. bf16 is widened by placing its bits in the high half
        of each fp32 (exact, and 5x faster than torch's conversion on this CPU)."""
        g = self.geometry
        shape = (g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)
        if g.dtype != torch.bfloat16:
            return self._view(data).float()
        wide = getattr(self._scratch, "wide", None)
        if wide is None or wide.shape[0] != len(data) // 2:
            # One per worker thread, reused: the low halves stay zero, only the high ones are written.
            wide = self._scratch.wide = np.zeros((len(data) // 2, 2), np.uint16)
        wide[:, 1] = np.frombuffer(data, np.uint16)  # little-endian: the high half of each fp32
        return torch.from_numpy(wide.view(np.float32).reshape(shape))

    @staticmethod
    def _scale(amax: torch.Tensor) -> torch.Tensor:
        """fp16 scales (what is stored), as fp32; an all-zero group gets 1 (its values stay 0)."""
        scale = (amax / 127.0).clamp(max=_FP16_MAX).half().float()
        return torch.where(scale > 0, scale, torch.ones_like(scale))

    def encode(self, data: memoryview, page: PageContext) -> memoryview:
        if len(data) != self.geometry.page_bytes:
            raise CodecError("length")
        x = self._as_fp32(data)
        out = torch.empty(self._stored, dtype=torch.uint8)
        q = out[: self._values].view(torch.int8).view(x.shape)
        scales = out[self._values :].view(torch.float16)
        pos = 0
        for c in range(x.shape[0]):
            comp = x[c]
            per_channel = c == 0 and x.shape[0] == 2
            amax = comp.abs().amax(dim=1 if per_channel else 3, keepdim=True)
            scale = self._scale(amax)
            q[c].copy_((comp * scale.reciprocal()).round_().clamp_(-127, 127))
            scales[pos : pos + scale.numel()].copy_(scale.reshape(-1))
            pos += scale.numel()
        return memoryview(out.numpy())

    def decode(self, data: memoryview, page: PageContext, out: memoryview | None) -> memoryview | bytes:
        if len(data) != self._stored:
            raise CodecError("length")
        g = self.geometry
        raw = torch.frombuffer(memoryview(bytearray(data)) if data.readonly else data, dtype=torch.uint8)
        q = raw[: self._values].view(torch.int8).view(g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim)
        scales = raw[self._values :].view(torch.float16)
        if out is None or len(out) != g.page_bytes:
            out = memoryview(bytearray(g.page_bytes))
        dst = self._view(out)
        pos = 0
        for c in range(g.components):
            per_channel = c == 0 and g.components == 2
            shape = (g.num_layers, 1, g.num_kv_heads, g.head_dim) if per_channel else (
                g.num_layers, g.page_size, g.num_kv_heads, 1)
            n = shape[0] * shape[1] * shape[2] * shape[3]
            scale = scales[pos : pos + n].float().view(shape)
            pos += n
            torch.mul(q[c].float(), scale, out=dst[c]) if g.dtype == torch.float32 else dst[c].copy_(q[c].float() * scale)
        return out
