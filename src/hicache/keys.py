"""Token validation and chained page keys.

A page key names the KV of one page *and everything before it*: ``key_i = H(key_{i-1} || ids_i)``,
seeded with a namespace digest built from everything that changes the bytes of the KV (model name
and revision, geometry, dtype, page size) plus an optional tenant salt. Two caches that disagree on
any of these can never hand each other pages, even through a shared storage tier.

Token ids travel as the raw bytes of an int64 array so that matching and hashing work per page
(``memcmp`` and one hash call), never per token in Python.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import InvalidTokensError

if TYPE_CHECKING:
    from .config import HiCacheConfig

__all__ = ["Namespace", "TokenBytes", "as_token_bytes", "chain_keys", "KEY_BYTES", "TOKEN_BYTES"]

KEY_BYTES = 16
TOKEN_BYTES = 8  # int64 token ids

TokenBytes = bytes


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two pages to be interchangeable."""

    model: str
    revision: str
    attention: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    tenant_salt: str = ""

    @classmethod
    def from_config(cls, config: HiCacheConfig) -> Namespace:
        m = config.model
        return cls(
            model=m.name,
            revision=m.revision,
            attention=m.attention,
            num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            dtype=m.dtype,
            page_size=config.page_size,
            tenant_salt=config.tenant_salt,
        )

    @property
    def digest(self) -> bytes:
        """The seed of every page-key chain in this namespace."""
        fields = "\x1f".join(
            str(v)
            for v in (
                "hicache-ns-v1",
                self.model,
                self.revision,
                self.attention,
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                self.dtype,
                self.page_size,
                self.tenant_salt,
            )
        )
        return hashlib.blake2b(fields.encode(), digest_size=KEY_BYTES).digest()


def as_token_bytes(tokens: Any) -> TokenBytes:
    """Validate token ids and return them as int64 bytes.

    Accepts a sequence of ints or a 1-D integer tensor. Raises ``InvalidTokensError`` for anything
    else (floats, bools in a tensor, negatives, nested sequences) without per-token Python work.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        torch = None  # type: ignore[assignment]
    if torch is not None and isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise InvalidTokensError(f"token ids must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise InvalidTokensError(f"token ids must be integers, got a {tokens.dtype} tensor")
        ids = tokens.detach().to("cpu", torch.int64).contiguous()
        if ids.numel() and int(ids.min()) < 0:
            raise InvalidTokensError("token ids must be non-negative")
        return ids.numpy().tobytes()
    if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
        raise InvalidTokensError(
            f"token ids must be a sequence of ints or a 1-D integer tensor, got {type(tokens).__name__}"
        )
    try:
        ids_arr = array("q", tokens)
    except (TypeError, OverflowError) as exc:
        raise InvalidTokensError(f"token ids must be non-negative integers: {exc}") from None
    if ids_arr and min(ids_arr) < 0:
        raise InvalidTokensError("token ids must be non-negative")
    return ids_arr.tobytes()


def chain_keys(seed: bytes, tokens: TokenBytes, page_size: int, num_pages: int | None = None) -> list[bytes]:
    """Chained keys of the full pages of ``tokens``, continuing the chain from ``seed``.

    ``seed`` is the namespace digest for the first page of a sequence, or the key of the page just
    before ``tokens`` when continuing a chain.
    """
    page_bytes = page_size * TOKEN_BYTES
    total = len(tokens) // page_bytes if num_pages is None else num_pages
    keys: list[bytes] = []
    prev = seed
    view = memoryview(tokens)
    for i in range(total):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES)
        h.update(view[i * page_bytes : (i + 1) * page_bytes])
        prev = h.digest()
        keys.append(prev)
    return keys
