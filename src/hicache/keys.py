"""Token validation and chained page keys.

A page key names the KV of one page *and everything before it*: ``key_i = H(key_{i-1} || ids_i)``,
seeded with a namespace digest built from everything that changes the bytes of the KV (model name
and revision, geometry, dtype, page size) plus an optional tenant salt. Two caches that disagree on
any of these can never hand each other pages, even through a shared storage tier.

Under tensor or pipeline parallelism the namespace also records which slice of the model a rank's
pages hold (its KV heads, its layers): ranks never read each other's heads, and a page written at one
layout is served at another only where the slice is the same. An MLA latent is the same on every TP
rank: one rank writes it (``writes_storage``), all read it.

An engine that names its pages itself (SGLang's chained page hashes) gets hicache keys with
``external_page_keys``: the engine's name keyed by the namespace digest.

With a ``tenant_key`` the seed is a keyed hash (``TenantKey``): nobody without the key can compute
the key of any page, and the subkeys that name pages in storage and authenticate their contents
(``page_format.PageCodec``) derive from the same secret.

Token ids travel as the raw bytes of an int64 array so that matching and hashing work per page
(``memcmp`` and one hash call), never per token in Python.
"""

from __future__ import annotations

import hashlib
import hmac
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidTokensError

__all__ = [
    "Namespace", "TenantKey", "TokenBytes", "as_token_bytes", "chain_keys", "external_page_keys", "variant_digest",
    "KEY_BYTES", "TOKEN_BYTES",
]

KEY_BYTES = 16
TOKEN_BYTES = 8  # int64 token ids

TokenBytes = bytes


class TenantKey:
    """A tenant's secret, kept only as a root key that subkeys are derived from; never shown.

    Derivation is keyed BLAKE2b (standard library): ``root = BLAKE2b(key=secret, person="hicache-tenant")``
    and ``subkey(purpose, context) = BLAKE2b(context, key=root, person=purpose)``, 32 bytes each. One
    subkey per purpose (the key-chain seed, page names, page MACs) so no output of one use helps
    with another. The repr, ``str`` and pickling never reveal the secret.
    """

    __slots__ = ("_root",)

    def __init__(self, secret: str | bytes) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if not raw:
            raise ValueError("a tenant key cannot be empty")
        # BLAKE2b takes at most 64 key bytes: longer secrets are hashed down first.
        key = raw if len(raw) <= 64 else hashlib.blake2b(raw, person=b"hicache-longkey").digest()
        self._root = hashlib.blake2b(b"", key=key, person=b"hicache-tenant", digest_size=32).digest()

    def derive(self, purpose: str, context: bytes = b"") -> bytes:
        """A 32-byte subkey for ``purpose`` (at most 16 ASCII characters) and ``context``."""
        return hashlib.blake2b(context, key=self._root, person=purpose.encode(), digest_size=32).digest()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TenantKey) and hmac.compare_digest(self._root, other._root)

    def __hash__(self) -> int:
        return hash(self.derive("hash"))

    def __repr__(self) -> str:
        return "TenantKey('**********')"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("a TenantKey is not pickled: pass the config (with its SecretStr) instead")


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two pages to be interchangeable.

    Plain values: the composition root reads them from the config (``containers.namespace_from_config``).
    """

    model: str
    revision: str
    attention: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    tenant_salt: str = ""
    tenant_key: TenantKey | None = field(default=None, repr=False)
    # The parallel layout: ``num_layers`` and ``num_kv_heads`` above are what this rank holds.
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0  # the model layer this stage's first layer is
    total_kv_heads: int | None = None  # over all TP ranks; None: num_kv_heads * tp_size
    # The layers' kinds (``LayerKinds.canonical()``): "" when every layer is full attention.
    layer_kinds: str = ""

    @property
    def kv_head_range(self) -> tuple[int, int, int] | None:
        """``(first, end, total)``: the model's KV heads this rank holds; ``None`` for MLA (one latent, every rank).

        Heads are split in rank order; with fewer KV heads than ranks, ``tp_size / total`` consecutive
        ranks hold the same head (as SGLang's and vLLM's QKV projections replicate them).
        """
        if self.attention == "mla":
            return None
        total = self.total_kv_heads or self.num_kv_heads * self.tp_size
        if total >= self.tp_size:
            first = self.tp_rank * self.num_kv_heads
        else:
            first = self.tp_rank // (self.tp_size // total)
        return first, first + self.num_kv_heads, total

    @property
    def layer_range(self) -> tuple[int, int]:
        """``(first, end)``: the model layers this pipeline stage holds."""
        return self.first_layer, self.first_layer + self.num_layers

    @property
    def writes_storage(self) -> bool:
        """Whether this rank writes shared storage. Pages that several ranks hold alike (an MLA latent,
        a replicated KV head) are written by the first of those ranks only; all of them read."""
        if self.attention == "mla":
            return self.tp_rank == 0
        heads = self.kv_head_range
        assert heads is not None
        total = heads[2]
        return total >= self.tp_size or self.tp_rank % (self.tp_size // total) == 0

    def _layout_fields(self) -> tuple[object, ...]:
        """The parallel slice and a hybrid layout, in the digest only when they are not the plain
        case (the whole model, every layer full), so digests of such caches are what they always were."""
        out: tuple[object, ...] = ()
        heads = self.kv_head_range
        if heads is not None and (heads[0] != 0 or heads[1] != heads[2]):
            out += ("kv-heads", *heads)
        if self.first_layer != 0:
            out += ("layers", *self.layer_range)
        if self.layer_kinds:
            out += ("layer-kinds", self.layer_kinds)
        return out

    @property
    def digest(self) -> bytes:
        """The seed of every page-key chain in this namespace (secret when there is a tenant key)."""
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
                *self._layout_fields(),
            )
        )
        if self.tenant_key is None:
            return hashlib.blake2b(fields.encode(), digest_size=KEY_BYTES).digest()
        seed_key = self.tenant_key.derive("chain-seed")
        return hashlib.blake2b(fields.encode(), key=seed_key, digest_size=KEY_BYTES).digest()


def variant_digest(digest: bytes, variant: str) -> bytes:
    """The namespace digest of a storage variant of ``digest`` (pages written through a codec chain).

    Pages stored through a codec chain (quantised, compressed, encrypted) are interchangeable only
    with pages of the same chain: their storage names and header namespace field derive from this
    digest, so a reader that asked for exact KV never meets a quantised page under its names.
    """
    return hashlib.blake2b(variant.encode(), key=digest, person=b"hicache-variant", digest_size=KEY_BYTES).digest()


def external_page_keys(seed: bytes, names: Sequence[str | bytes]) -> list[bytes]:
    """hicache page keys for pages an engine names itself (SGLang's 64-hex page hashes).

    Each name is keyed by ``seed`` (the namespace digest), so one engine name in two namespaces
    (another model, rank slice, page order or tenant) is two different pages. The names must
    already stand for the page's whole prefix (chained hashes): hicache does not chain them.
    """
    out = []
    for name in names:
        raw = name.encode() if isinstance(name, str) else bytes(name)
        out.append(hashlib.blake2b(raw, key=seed, digest_size=KEY_BYTES, person=b"hicache-extkey").digest())
    return out


_INT_DTYPES = frozenset(
    f"torch.{name}" for name in ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
)


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
        if tokens.is_meta:
            raise InvalidTokensError("token ids are on the meta device and have no values: pass a real tensor")
        if tokens.layout != torch.strided or tokens.is_nested:
            raise InvalidTokensError(
                f"token ids must be a dense tensor, got layout {tokens.layout}: call .to_dense() first"
            )
        if tokens.dim() != 1:
            raise InvalidTokensError(f"token ids must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if str(tokens.dtype) not in _INT_DTYPES:
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
