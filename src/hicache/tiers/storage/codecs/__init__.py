"""Codec chains for storage tiers: ``codec: [int8, lossless, aes-gcm]`` per tier (see ``base.py``).

``build_chain`` turns a tier's validated ``codec`` entries into a ``CodecChain``; ``KEYLESS`` are the
stages a reader can decode from the header alone (a page written with ``lossless`` by a tier whose
reader has no ``lossless`` stage is still read).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ...base import KVGeometry
from .base import Codec, CodecChain, CodecError, PageContext, run_decode, run_encode

__all__ = [
    "CODEC_KINDS", "Codec", "CodecChain", "CodecError", "PageContext", "build_chain", "keyless_stage", "name_of_id",
    "run_decode", "run_encode",
]

#: kind in the config -> id in the header (ids are never reused)
CODEC_KINDS = {"int8": 1, "lossless": 2, "aes-gcm": 3}
_NAMES = {v: k for k, v in CODEC_KINDS.items()}


def name_of_id(codec_id: int) -> str:
    return _NAMES.get(codec_id, f"unknown({codec_id})")


def build_chain(
    entries: Sequence[Any], *, geometry: KVGeometry, namespace: bytes, tenant_secret: bytes | None
) -> CodecChain:
    """The stages of ``entries`` (``config.CodecConfig``), with keys derived for ``namespace``.

    ``tenant_secret`` is the tenant key's subkey for page encryption (``None`` without a tenant key).
    """
    stages: list[Codec] = []
    for entry in entries:
        if entry.kind == "int8":
            from .int8 import Int8

            stages.append(Int8(geometry))
        elif entry.kind == "lossless":
            from .lossless import Lossless

            stages.append(Lossless(entry.coder, entry.level))
        elif entry.kind == "aes-gcm":
            from .aes_gcm import AesGcm, derive_page_key

            if entry.key is not None:
                secret = entry.key.get_secret_value().encode()
            elif tenant_secret is not None:
                secret = tenant_secret
            else:
                raise ValueError("codec aes-gcm needs a key: set tenant_key, or the codec's own key")
            stages.append(AesGcm(derive_page_key(secret, namespace)))
        else:  # pragma: no cover - the config validates kinds
            raise ValueError(f"unknown codec {entry.kind!r}")
    return CodecChain(stages)


def keyless_stage(codec_id: int) -> Codec | None:
    """A stage that decodes from its own framing with no key or geometry (``lossless``), else ``None``."""
    if codec_id == CODEC_KINDS["lossless"]:
        from .lossless import Lossless

        return Lossless()
    return None
