"""``lossless``: byte-shuffle and an entropy coder, both from blosc2, one thread per page.

Why blosc2 (``benchmarks/page_codecs.py`` on SmolLM2's KV, docs/codecs.md): its shuffle is SIMD C
code that runs inside the compressor, where shuffling with numpy first (for ``zstandard`` or ``lz4``)
costs a strided copy that alone runs below 1 GB/s; and it decompresses into the host page itself.
With Zstd level 1 it gives the best ratio measured (1.44x on bf16 KV, 1.18x on fp32) at the same
ratio as ``zstandard`` with a numpy shuffle, and decodes 3-4x faster; ``coder: lz4`` trades ratio
for speed.

blosc2 frames say how many bytes they decode to: that is checked against what the page must hold
before decoding (blosc2 writes past a destination that is too small), and decoding runs only on
bytes already verified (checksum, MAC or AEAD tag).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from .base import Codec, CodecError, PageContext

__all__ = ["Lossless"]

_OVERHEAD = 64  # blosc2 frame header and per-block headers for an incompressible page, generously
_BLOCK = 256 * 1024  # split pages in blocks this size: better ratio than tiny blocks, cache-friendly


class Lossless(Codec):
    name: ClassVar[str] = "lossless"
    id: ClassVar[int] = 2
    role = "lossless"

    def __init__(self, coder: Literal["zstd", "lz4"] = "zstd", level: int = 1) -> None:
        import blosc2  # an optional dependency: pip install 'hicache[codecs]'

        self._blosc2 = blosc2
        self.coder = coder
        self.level = level
        self._codec = {"zstd": blosc2.Codec.ZSTD, "lz4": blosc2.Codec.LZ4}[coder]

    def encoded_bytes(self, n: int) -> int | None:
        return None

    def max_encoded_bytes(self, n: int) -> int:
        return n + _OVERHEAD + 16 * (n // _BLOCK + 1)

    def encode(self, data: memoryview, page: PageContext) -> bytes:
        b = self._blosc2
        return b.compress2(
            data, typesize=page.itemsize, clevel=self.level, codec=self._codec, filters=[b.Filter.SHUFFLE],
            nthreads=1, blocksize=_BLOCK, splitmode=b.SplitMode.ALWAYS_SPLIT,
        )

    def decode(self, data: memoryview, page: PageContext, out: memoryview | None) -> memoryview | bytes:
        b = self._blosc2
        try:
            nbytes, cbytes, _ = b.get_cbuffer_sizes(data)
        except Exception as exc:
            raise CodecError("lossless frame") from exc
        expected = page.decoded_bytes
        if cbytes != len(data) or (expected is not None and nbytes != expected) or nbytes > page.max_decoded_bytes:
            raise CodecError("lossless frame")
        import numpy as np

        dst = out if out is not None and len(out) == nbytes else memoryview(np.empty(nbytes, np.uint8))
        try:
            b.decompress2(data, dst=np.frombuffer(dst, np.uint8), nthreads=1)
        except Exception as exc:
            raise CodecError("lossless frame") from exc
        return dst
