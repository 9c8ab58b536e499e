"""The canonical page format: how one page of KV looks once it leaves memory, and what it is stored as.

Every storage backend stores a page as ``header + payload`` under a 16-byte *storage key*:

* the payload is the page's KV in page-first order ``[C, L, page_size, H, D]`` (contiguous, native
  byte order), whatever the host pool's layout, so a page written from a ``layer_first`` host pool
  is read back by a ``page_first`` one;
* the header (``HEADER_BYTES``, little-endian) names what the payload is: magic, format version,
  a namespace field, the storage key, KV geometry, dtype, page size, payload length, and a check
  value over the header fields and the payload.

Two modes (see docs/security.md):

* **No tenant key** (format 1, integrity only): the storage key is the page key, the namespace
  field is the namespace digest, the check value an xxh3-64 checksum. It catches torn writes, bit
  rot, other models and misplaced pages, not a writer who means harm: anyone who can write to the
  store can compute valid pages.
* **A tenant key** (format 5, authenticity): the storage key is ``BLAKE2b(page key, key=K_name)``,
  so the names in the store do not let anyone continue a key chain; the namespace field is an
  identifier derived from the MAC key (nothing a reader can derive keys from); the check value is
  an AES-256-GMAC (a fresh 12-byte nonce and the 16-byte tag, ``K_gmac``) over the header fields
  and the payload. Forged pages, pages of another prompt copied under this name (the name is
  inside the MAC) and other tenants' pages all fail the check. ``K_name``, ``K_mac`` and
  ``K_gmac`` derive from the tenant key and the namespace digest (``keys.TenantKey``). GMAC runs
  on AES-NI and carry-less multiply at about 8 GB/s per core here, 1.4x keyed BLAKE3 (format 2,
  which it replaced: the read and the write of a keyed tier check every byte) and ~25x keyed
  BLAKE2b (``benchmarks/page_mac.py``), and releases the GIL, so the tier's threads check pages
  while others are read.

* **A codec chain** (formats 3 and 6: a tier's ``codec:`` list, ``codecs/``): the header also records
  the ids of the stages applied (up to 4 bytes), the payload is what the last stage produced
  (its length in the header), and the namespace is the chain's variant of the namespace digest
  (``keys.variant_digest``), so storage names and the namespace field differ from those of exact
  pages and of other chains: a reader that asked for exact KV never receives a quantised page.
  Format 3 is unkeyed (xxh3-64 over the header fields and the stored payload, or nothing where
  the chain encrypts), format 6 keyed (the GMAC, or nothing where it encrypts): with
  ``aes-gcm`` in the chain the GCM tag authenticates the header fields (associated data) and the
  ciphertext, standing in for the checksum or MAC. The check runs on the stored bytes before any
  stage decodes them.

A page is used only if every field matches what the reader expects, the check value is right and
the header's bytes past the check value (padding, written as zeros in every format) are zero: a
truncated, corrupted, forged, foreign (another model, geometry or tenant) or misplaced page, or one
with a byte changed anywhere in its 128-byte header, is a *miss*, never data handed to an engine.
(The padding is outside the checksum, MAC and AEAD tag; zero is its only accepted value, so there
is nothing there to forge, and every page written before the check was added still reads.)
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...keys import KEY_BYTES, TenantKey, variant_digest
from ..base import KVGeometry
from .codecs import CodecChain, CodecError, name_of_id, run_decode, run_encode

__all__ = [
    "CODEC_FORMAT_VERSION", "HEADER_BYTES", "FORMAT_VERSION", "KEYED_CODEC_FORMAT_VERSION", "KEYED_FORMAT_VERSION",
    "MAGIC", "OLD_KEYED_FORMAT_VERSIONS", "PageCodec", "PageHeader", "StoredPageCheck", "check_stored_page", "page_codecs",
    "parse_header", "writer_codec",
]

MAGIC = b"HICACHE\x00"
FORMAT_VERSION = 1  # xxh3-64 checksum, no key
KEYED_FORMAT_VERSION = 5  # keyed: AES-256-GMAC (2 was the keyed BLAKE3 MAC)
CODEC_FORMAT_VERSION = 3  # a codec chain, unkeyed: xxh3-64 (or the AEAD tag)
KEYED_CODEC_FORMAT_VERSION = 6  # a codec chain, keyed: AES-256-GMAC (or the AEAD tag; 4 was BLAKE3)
#: Keyed pages of earlier versions (a BLAKE3 MAC; 4 through a codec chain): never read, shown as unverifiable.
OLD_KEYED_FORMAT_VERSIONS = (2, 4)
HEADER_BYTES = 128
_CODEC_IDS = 4  # stage ids recorded in a format 3/6 header

# magic, version, header bytes, namespace, key, C, L, page_size, H, D, dtype, payload length
_FIELDS = struct.Struct(f"<8sHH{KEY_BYTES}s{KEY_BYTES}sIIIII16sQ")
_CHECKSUM = struct.Struct("<Q")
_CHECKSUM_AT = _FIELDS.size
_NONCE_BYTES = 12  # a fresh random nonce per written page, stored before the tag
_TAG_BYTES = 16
_MAC_BYTES = _NONCE_BYTES + _TAG_BYTES
assert _CHECKSUM_AT + max(_CHECKSUM.size, _MAC_BYTES) <= HEADER_BYTES
# formats 3 and 6 (and 4): the same fields, then the codec ids (zero-padded) and 4 reserved zero bytes
_CODEC_FIELDS = struct.Struct(f"<8sHH{KEY_BYTES}s{KEY_BYTES}sIIIII16sQ{_CODEC_IDS}s4x")
_CODEC_CHECK_AT = _CODEC_FIELDS.size
assert _CODEC_CHECK_AT + _MAC_BYTES <= HEADER_BYTES


def _padding_at(version: int, keyed: bool, encrypted: bool) -> int | None:
    """Where a header's zero padding starts (after its fields and check value); ``None``: a version
    this reader does not lay out (an earlier keyed format)."""
    if version in (FORMAT_VERSION, KEYED_FORMAT_VERSION):
        return _CHECKSUM_AT + (_MAC_BYTES if keyed else _CHECKSUM.size)
    if version in (CODEC_FORMAT_VERSION, KEYED_CODEC_FORMAT_VERSION):
        return _CODEC_CHECK_AT + (0 if encrypted else _MAC_BYTES if keyed else _CHECKSUM.size)
    return None


def _zero_padding(header: bytes | memoryview, at: int) -> bool:
    return bytes(header[at:HEADER_BYTES]) == bytes(HEADER_BYTES - at)


@dataclass(frozen=True)
class PageCodec:
    """Names pages in storage, writes and checks their headers, for one namespace and geometry.

    ``encode`` and ``check`` are pure CPU work (per 3 MiB page: ~0.1 ms for the checksum, ~0.6 ms
    for the MAC); callers run them in a worker thread, one batch of pages per hop.
    """

    namespace: bytes
    geometry: KVGeometry
    tenant_key: TenantKey | None = field(default=None, repr=False, compare=False)
    #: The tier's codec stages (none: formats 1 and 2, the payload is the KV itself, read in place).
    chain: CodecChain = field(default_factory=CodecChain, compare=False)
    #: A part of each page's layers (``layer_split.py``: ``"layers:full"``, ``"layers:sliding"``):
    #: stored under names and a namespace of its own, so a part is never read as a whole page,
    #: as the other part, or as a part of another layout. ``geometry`` then counts its layers only.
    part: str = ""
    # Derived in __post_init__ (never shown):
    _gmac: Any = field(init=False, default=None, repr=False, compare=False)  # AESGCM under K_gmac (a tenant key)
    _gmac_key: bytes = field(init=False, default=b"", repr=False, compare=False)
    _names: Any = field(init=False, default=None, repr=False, compare=False)  # a keyed BLAKE2b to copy
    _namespace_field: bytes = field(init=False, default=b"", repr=False, compare=False)
    _ids: bytes = field(init=False, default=b"", repr=False, compare=False)

    def __post_init__(self) -> None:
        ids = self.chain.ids
        # A chain's pages are another namespace: other names, another namespace field, other keys.
        namespace = variant_digest(self.namespace, "codec:" + self.chain.variant) if ids else self.namespace
        if self.part:
            namespace = variant_digest(namespace, self.part)  # likewise a part of the layers
        if self.tenant_key is None:
            # exact whole pages keep the page key as their name
            name_key = namespace if ids or self.part else None
            namespace_field = namespace
        else:
            name_key = self.tenant_key.derive("page-name", namespace)
            id_key = self.tenant_key.derive("page-mac", namespace)  # K_mac: only the namespace field's identifier now
            namespace_field = hashlib.blake2b(b"namespace-id", key=id_key, digest_size=KEY_BYTES).digest()
            gmac_key = self.tenant_key.derive("page-gmac", namespace)
            object.__setattr__(self, "_gmac_key", gmac_key)
            object.__setattr__(self, "_gmac", AESGCM(gmac_key))
        object.__setattr__(self, "_names", None if name_key is None else hashlib.blake2b(key=name_key, digest_size=16))
        object.__setattr__(self, "_namespace_field", namespace_field)
        object.__setattr__(self, "_ids", ids)

    @property
    def keyed(self) -> bool:
        """True when pages are named and authenticated with a tenant key."""
        return self.tenant_key is not None

    @property
    def version(self) -> int:
        if self._ids:
            return KEYED_CODEC_FORMAT_VERSION if self.keyed else CODEC_FORMAT_VERSION
        return KEYED_FORMAT_VERSION if self.keyed else FORMAT_VERSION

    @property
    def payload_bytes(self) -> int:
        """Bytes of the page's KV (the logical payload)."""
        return self.geometry.page_bytes

    @property
    def encoded(self) -> bool:
        """True when pages go through a codec chain (stored size varies; read into staging buffers)."""
        return bool(self._ids)

    @property
    def max_stored_bytes(self) -> int:
        """The largest stored payload a page of this codec can have."""
        return self.chain.max_stored_bytes(self.payload_bytes)

    def storage_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """What each page key is stored under: itself without a tenant key, a keyed hash of it with one."""
        if self._names is None:
            return list(keys)
        out = []
        for key in keys:
            h = self._names.copy()
            h.update(key)
            out.append(h.digest())
        return out

    def _fields(self, key: bytes, stored_bytes: int | None = None) -> bytes:
        g = self.geometry
        dtype = str(g.dtype).removeprefix("torch.").encode()
        if not self._ids:
            return _FIELDS.pack(
                MAGIC, self.version, HEADER_BYTES, self._namespace_field, key,
                g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim, dtype, self.payload_bytes,
            )
        return _CODEC_FIELDS.pack(
            MAGIC, self.version, HEADER_BYTES, self._namespace_field, key,
            g.components, g.num_layers, g.page_size, g.num_kv_heads, g.head_dim, dtype,
            0 if stored_bytes is None else stored_bytes, self._ids,
        )

    def _aad(self, key: bytes) -> bytes:
        """What an encrypting stage authenticates: every header field but the stored length (the
        ciphertext's length is authenticated by GCM itself)."""
        return self._fields(key, 0)

    def _check_value(
        self, fields: bytes | memoryview, payload: Sequence[memoryview], nonce: bytes | None = None
    ) -> bytes:
        """The xxh3-64 checksum, or with a tenant key the GMAC: ``nonce + tag`` (a fresh nonce when
        writing, the stored one when checking).

        The GMAC is AES-256-GCM with the payload as associated data and the header fields as the
        (discarded) plaintext, so the tag covers both without joining them into one buffer; it runs
        on AES-NI and carry-less multiply at about 1.4x BLAKE3's speed per core here and releases
        the GIL (``benchmarks/page_mac.py``).
        """
        if self._gmac is None:
            x = xxhash.xxh3_64()
            x.update(fields)
            for piece in payload:
                x.update(piece)
            return _CHECKSUM.pack(x.intdigest())
        nonce = os.urandom(_NONCE_BYTES) if nonce is None else nonce
        if len(payload) == 1:
            return nonce + self._gmac.encrypt(nonce, bytes(fields), payload[0])[-_TAG_BYTES:]
        # A layer_first host page comes in pieces: the same tag, the associated data fed piece by piece.
        enc = Cipher(algorithms.AES(self._gmac_key), modes.GCM(nonce)).encryptor()
        for piece in payload:
            enc.authenticate_additional_data(piece)
        enc.update(bytes(fields))
        enc.finalize()
        return nonce + enc.tag

    def _stored_nonce(self, header: memoryview, at: int) -> bytes | None:
        return bytes(header[at : at + _NONCE_BYTES]) if self._gmac is not None else None

    def encode(self, key: bytes, payload: Sequence[memoryview], header: memoryview) -> None:
        """Write the header of ``payload`` (the page stored under ``key``, in pieces) into ``header``."""
        fields = self._fields(key)
        value = self._check_value(fields, payload)
        end = _CHECKSUM_AT + len(value)
        header[: len(fields)] = fields
        header[_CHECKSUM_AT:end] = value
        header[end:HEADER_BYTES] = bytes(HEADER_BYTES - end)

    def check(self, key: bytes, header: memoryview, payload: Sequence[memoryview]) -> str | None:
        """``None`` if ``header + payload`` is the page stored under ``key`` in this namespace, else why not."""
        if len(header) < HEADER_BYTES or sum(len(p) for p in payload) != self.payload_bytes:
            return "truncated"
        expected = self._fields(key)
        got = bytes(header[: _FIELDS.size])
        if got != expected:
            return self._mismatch(got)
        if not _zero_padding(header, _CHECKSUM_AT + (_MAC_BYTES if self.keyed else _CHECKSUM.size)):
            return "padding"
        value = self._check_value(expected, payload, self._stored_nonce(header, _CHECKSUM_AT))
        if not hmac.compare_digest(bytes(header[_CHECKSUM_AT : _CHECKSUM_AT + len(value)]), value):
            return "mac" if self.keyed else "checksum"
        return None

    # -- pages through a codec chain (formats 3 and 4) ------------------------------------------

    def encode_page(self, key: bytes, payload: Sequence[memoryview]) -> tuple[bytes, memoryview | bytes]:
        """``(header, stored payload)`` of the page stored under ``key``: its KV (in pieces, in order)
        through every stage, then the header with its check value (none where the chain encrypts).

        Pure CPU work for one page: the tier runs it in worker threads, one page per task.
        """
        if len(payload) == 1:
            data = payload[0]
        else:  # a layer_first host page: its pieces, joined in page-first order
            data = memoryview(bytearray(sum(len(p) for p in payload)))
            pos = 0
            for piece in payload:
                data[pos : pos + len(piece)] = piece
                pos += len(piece)
        stored = run_encode(self.chain.stages, data, self.geometry, self._aad(key))
        fields = self._fields(key, len(stored))
        header = bytearray(HEADER_BYTES)
        header[: len(fields)] = fields
        if self.chain.encryption is None:
            value = self._check_value(fields, [memoryview(stored)])
            header[_CODEC_CHECK_AT : _CODEC_CHECK_AT + len(value)] = value
        return bytes(header), stored

    def decode_page(self, key: bytes, header: memoryview, stored: memoryview, out: Sequence[memoryview]) -> str | None:
        """Check the page read under ``key`` (``header`` + ``stored``, its stored payload exactly) and
        decode it into ``out`` (the host page's pieces); ``None`` if done, else why it is a miss.

        The header's fields must be this codec's (namespace field, name, geometry, the same codec
        ids), then the check value (or the AEAD tag) must verify the stored bytes, and only then does
        any stage decode them. Pages past a failure are left unspecified in ``out``.
        """
        if len(header) < HEADER_BYTES:
            return "truncated"
        got = bytes(header[: _CODEC_FIELDS.size])
        expected = self._fields(key, len(stored))
        if got != expected:
            return self._codec_mismatch(got, key, len(stored))
        padding = _padding_at(self.version, self.keyed, self.chain.encryption is not None)
        assert padding is not None
        if not _zero_padding(header, padding):
            return "padding"
        if self.chain.encryption is None:
            value = self._check_value(expected, [stored], self._stored_nonce(header, _CODEC_CHECK_AT))
            if not hmac.compare_digest(bytes(header[_CODEC_CHECK_AT : _CODEC_CHECK_AT + len(value)]), value):
                return "mac" if self.keyed else "checksum"
        single = out[0] if len(out) == 1 else None
        try:
            decoded = run_decode(self.chain.stages, stored, self.geometry, self._aad(key), single)
        except CodecError as exc:
            return exc.reason
        if len(decoded) != self.payload_bytes:
            return "length"
        if single is None or not _same_buffer(decoded, single):
            view, pos = memoryview(decoded).cast("B"), 0
            for piece in out:
                piece[:] = view[pos : pos + len(piece)]
                pos += len(piece)
        return None

    def _codec_mismatch(self, got: bytes, key: bytes, stored_bytes: int) -> str:
        """Name the first header field (format 3/4) that differs from what this reader expects."""
        have = _CODEC_FIELDS.unpack(got)
        want = _CODEC_FIELDS.unpack(self._fields(key, stored_bytes))
        if have[0] != MAGIC:
            return "magic"
        if have[1:3] != want[1:3]:
            return "version"
        if have[3] != want[3]:
            return "namespace"
        if have[12] != want[12]:
            return "codec"  # stages this reader cannot (or must not) decode
        if have[4] != want[4]:
            return "key"
        if have[5:11] != want[5:11]:
            return "geometry"
        return "length"

    def _mismatch(self, got: bytes) -> str:
        if int.from_bytes(got[8:10], "little") in (CODEC_FORMAT_VERSION, KEYED_CODEC_FORMAT_VERSION):
            return "version"  # a page written through a codec chain, read by a tier without one
        """Name the first header field that differs (for the counters and the debug log)."""
        magic, version, header_bytes, namespace, _key, *geometry, payload_len = _FIELDS.unpack(got)
        if magic != MAGIC:
            return "magic"
        if version != self.version or header_bytes != HEADER_BYTES:
            # A format-1 page read with a key is unauthenticated; a format-5 page without one is
            # another tenant's: either way not ours.
            return "version"
        if namespace != self._namespace_field:
            return "namespace"
        if tuple(geometry) != tuple(_FIELDS.unpack(self._fields(_key))[5:-1]):
            return "geometry"
        if payload_len != self.payload_bytes:
            return "length"
        return "key"


def _same_buffer(a: memoryview | bytes, b: memoryview) -> bool:
    """True when ``a`` is ``b`` itself (a stage decoded in place), not a copy."""
    if not isinstance(a, memoryview):
        return False
    try:
        import numpy as np

        return np.may_share_memory(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
    except (TypeError, ValueError):
        return False


# --------------------------------------------------------------------------- inspection
#
# ``hicache inspect`` reads pages it did not ask for by page key: it lists storage names. What it
# can check, with and without a tenant key (see docs/operating.md, "hicache inspect"):
#
# * every header names the storage name it was written under, and the check value covers it, so
#   a page can be checked from its storage name alone: the page key (and the tokens behind it)
#   is never needed;
# * a format-1 page (no tenant key) is self-describing: its xxh3 checksum is recomputed from its
#   own header fields and payload, whatever model or geometry wrote it;
# * a format-5 page (a tenant key) can be checked only with the MAC key of its namespace: the
#   reader's own pages are verified exactly (name, fields, MAC); pages of another tenant or of
#   another model under the same key are "unverifiable": neither proven good nor proven bad;
# * nobody can check that a page holds the KV of the tokens its name stands for (the name is a
#   one-way hash of them), nor find pages whose predecessor in the chain is gone.


@dataclass(frozen=True)
class PageHeader:
    """The fields of a stored page's header, as written (nothing verified)."""

    version: int
    namespace: bytes  # the namespace digest (format 1) or an identifier derived from the MAC key (format 5)
    key: bytes  # the storage name the page was written under
    geometry: tuple[int, int, int, int, int]  # components, layers, page_size, kv heads, head dim
    dtype: str
    payload_bytes: int  # as stored (after the codec chain, if any)
    codecs: tuple[str, ...] = ()  # the stages applied, in order (formats 3 and 4)

    @property
    def shape(self) -> str:
        c, layers, page, heads, dim = self.geometry
        return f"{c}x{layers}x{page}x{heads}x{dim} {self.dtype}"

    @property
    def logical_bytes(self) -> int | None:
        """Bytes of the KV the page holds (``None`` for a dtype this version does not know)."""
        itemsize = _ITEMSIZE.get(self.dtype)
        if itemsize is None:
            return None
        c, layers, page, heads, dim = self.geometry
        return c * layers * page * heads * dim * itemsize

    @property
    def encrypted(self) -> bool:
        return "aes-gcm" in self.codecs


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
_CODED = (CODEC_FORMAT_VERSION, KEYED_CODEC_FORMAT_VERSION, OLD_KEYED_FORMAT_VERSIONS[1])


def parse_header(header: bytes | memoryview) -> PageHeader | None:
    """The header's fields, or ``None`` when it is not a hicache page header (short, wrong magic)."""
    if len(header) < HEADER_BYTES:
        return None
    raw = bytes(header[:HEADER_BYTES])
    version = int.from_bytes(raw[8:10], "little")
    codecs: tuple[str, ...] = ()
    if version in _CODED:
        magic, version, header_bytes, namespace, key, *geometry, dtype, payload_len, ids = _CODEC_FIELDS.unpack(
            raw[: _CODEC_FIELDS.size]
        )
        codecs = tuple(name_of_id(i) for i in ids.rstrip(b"\x00"))
    else:
        magic, version, header_bytes, namespace, key, *geometry, dtype, payload_len = _FIELDS.unpack(raw[: _FIELDS.size])
    if magic != MAGIC or header_bytes != HEADER_BYTES:
        return None
    return PageHeader(
        version=version, namespace=namespace, key=key, geometry=tuple(geometry),  # type: ignore[arg-type]
        dtype=dtype.rstrip(b"\x00").decode("ascii", "replace"), payload_bytes=payload_len, codecs=codecs,
    )


@dataclass(frozen=True)
class StoredPageCheck:
    """What ``check_stored_page`` found: ``status`` is ``ok`` (verified), ``corrupt`` (proven bad:
    safe to remove) or ``unverifiable`` (another tenant's or namespace's keyed page, or an
    encrypted page of a key the reader does not hold)."""

    status: str
    reason: str | None
    header: PageHeader | None
    ours: bool  # written by the reader's own namespace (and tenant key)


def page_codecs(codec: PageCodec | Sequence[PageCodec]) -> tuple[PageCodec, ...]:
    """A tier's codecs: one, or one per part of the layers (a layer-split tier)."""
    return (codec,) if isinstance(codec, PageCodec) else tuple(codec)


def writer_codec(codec: PageCodec | Sequence[PageCodec], header: PageHeader | None) -> PageCodec | None:
    """Of a tier's codecs, the one whose pages look like ``header`` (namespace field and format);
    ``None``: a page this config did not write."""
    if header is None:
        return None
    for c in page_codecs(codec):
        if header.version == c.version and header.namespace == c._namespace_field:
            return c
    return None


def check_stored_page(codec: PageCodec | Sequence[PageCodec], storage_key: bytes, blob: bytes | None) -> StoredPageCheck:
    """Check one page read whole from storage under ``storage_key``, as far as ``codec`` allows.

    A page of the reader's own codec chain is checked the way a fetch checks it (decoded too, so
    a lossless frame or a ciphertext that does not decode is corrupt); an unkeyed one of another
    chain by its xxh3 checksum over the stored bytes; an encrypted or keyed one of another
    namespace or key is unverifiable.
    """
    if blob is None:
        return StoredPageCheck("corrupt", "unreadable", None, False)
    header = parse_header(blob[:HEADER_BYTES])
    if header is None:
        return StoredPageCheck("corrupt", "not a hicache page" if len(blob) >= HEADER_BYTES else "truncated", None, False)
    mine = writer_codec(codec, header)
    ours = mine is not None
    codec = mine if mine is not None else page_codecs(codec)[0]
    payload = memoryview(blob)[HEADER_BYTES:]
    if header.key != storage_key:
        return StoredPageCheck("corrupt", "stored under another name", header, ours)
    if header.payload_bytes != len(payload):
        return StoredPageCheck("corrupt", "truncated" if len(payload) < header.payload_bytes else "length", header, ours)
    logical = header.logical_bytes
    if header.version not in _CODED and logical is not None and logical != header.payload_bytes:
        return StoredPageCheck("corrupt", "geometry", header, ours)
    keyed = header.version in (KEYED_FORMAT_VERSION, KEYED_CODEC_FORMAT_VERSION)
    padding = _padding_at(header.version, keyed, header.encrypted)
    if padding is not None and not _zero_padding(blob, padding):
        return StoredPageCheck("corrupt", "padding", header, ours)  # no writer of this format leaves it nonzero
    if ours:
        if codec.encoded:
            out = memoryview(bytearray(codec.payload_bytes))
            reason = codec.decode_page(storage_key, memoryview(blob)[:HEADER_BYTES], payload, [out])
        else:
            reason = codec.check(storage_key, memoryview(blob)[:HEADER_BYTES], [payload])
        return StoredPageCheck("ok" if reason is None else "corrupt", reason, header, True)
    if header.version in (FORMAT_VERSION, CODEC_FORMAT_VERSION) and not header.encrypted:
        # Unkeyed: anyone can recompute the checksum from the page's own fields.
        fields, at = (_FIELDS.size, _CHECKSUM_AT) if header.version == FORMAT_VERSION else (_CODEC_FIELDS.size, _CODEC_CHECK_AT)
        x = xxhash.xxh3_64()
        x.update(blob[:fields])
        x.update(payload)
        good = _CHECKSUM.unpack(blob[at : at + _CHECKSUM.size])[0] == x.intdigest()
        return StoredPageCheck("ok" if good else "corrupt", None if good else "checksum", header, False)
    if header.version in OLD_KEYED_FORMAT_VERSIONS:
        return StoredPageCheck("unverifiable", "keyed by an earlier format (a BLAKE3 MAC): never read", header, False)
    if header.version in (KEYED_FORMAT_VERSION, KEYED_CODEC_FORMAT_VERSION, CODEC_FORMAT_VERSION):
        why = "encrypted with a key this config does not hold" if header.encrypted else "keyed by another tenant key or namespace"
        return StoredPageCheck("unverifiable", why, header, False)
    return StoredPageCheck("corrupt", "version", header, False)
