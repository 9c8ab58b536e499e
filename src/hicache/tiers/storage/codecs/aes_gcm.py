"""``aes-gcm``: AES-256-GCM encryption at rest (the ``cryptography`` package, OpenSSL underneath).

* **Key**: 32 bytes from HKDF-SHA256, over the tenant key's subkey for this purpose (``tenant_key``
  in the config) or over a key set on the stage itself (``{kind: aes-gcm, key: ${...}}``), with the
  namespace digest as the salt: each model, geometry and tenant salt gets its own key.
* **Nonce**: 12 random bytes per write (``os.urandom``), stored before the ciphertext. With random
  nonces one key should seal fewer than 2**32 pages (NIST SP 800-38D); a key per namespace keeps
  that far away for a cache, and rewriting a page uses a fresh nonce.
* **Associated data**: the header's fields (magic, format, namespace field, the storage name, which
  is the page key or its keyed hash, geometry, dtype and the codec ids): a page copied under
  another name, into another namespace or with another header fails to decrypt.
* **Tag**: 16 bytes after the ciphertext. It authenticates the page (header fields and
  ciphertext), standing in for the checksum or MAC: a page that fails to decrypt is a miss.

Stored payload: ``nonce (12) || ciphertext || tag (16)``. ``encrypt_into`` / ``decrypt_into`` write
straight into the output buffer (the host page on read), so a page is touched once each way.
"""

from __future__ import annotations

import hashlib
import os
from typing import ClassVar

import numpy as np

from .base import Codec, CodecError, PageContext

__all__ = ["AesGcm", "derive_page_key"]

NONCE_BYTES = 12
TAG_BYTES = 16


def derive_page_key(secret: bytes, namespace: bytes) -> bytes:
    """The 32-byte AES key for one namespace: HKDF-SHA256(secret, salt=namespace)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=namespace, info=b"hicache aes-256-gcm page key").derive(
        secret
    )


class AesGcm(Codec):
    name: ClassVar[str] = "aes-gcm"
    id: ClassVar[int] = 3
    role = "encryption"

    def __init__(self, key: bytes) -> None:
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # pip install 'hicache[codecs]'

        if len(key) != 32:
            raise ValueError("AES-256-GCM takes a 32-byte key")
        self._aead = AESGCM(key)
        self._invalid = InvalidTag
        # Pages sealed under another key are another namespace's: other names, never a decrypt war.
        self._fingerprint = hashlib.blake2b(key, person=b"hicache-aes-id", digest_size=8).hexdigest()

    @property
    def variant(self) -> str:
        return f"{self.name}:{self._fingerprint}"

    def __repr__(self) -> str:
        return "<AesGcm aes-gcm key=**********>"

    def encoded_bytes(self, n: int) -> int | None:
        return n + NONCE_BYTES + TAG_BYTES

    def max_encoded_bytes(self, n: int) -> int:
        return n + NONCE_BYTES + TAG_BYTES

    def encode(self, data: memoryview, page: PageContext) -> memoryview | bytes:
        nonce = os.urandom(NONCE_BYTES)
        if not hasattr(self._aead, "encrypt_into"):  # cryptography before encrypt_into: one more copy
            return nonce + self._aead.encrypt(nonce, bytes(data), page.aad)
        out = np.empty(len(data) + NONCE_BYTES + TAG_BYTES, np.uint8)
        out[:NONCE_BYTES] = np.frombuffer(nonce, np.uint8)
        self._aead.encrypt_into(nonce, data, page.aad, out[NONCE_BYTES:])
        return memoryview(out)

    def decode(self, data: memoryview, page: PageContext, out: memoryview | None) -> memoryview | bytes:
        n = len(data) - NONCE_BYTES - TAG_BYTES
        if n < 0 or n > page.max_decoded_bytes or (page.decoded_bytes is not None and n != page.decoded_bytes):
            raise CodecError("length")
        nonce = bytes(data[:NONCE_BYTES])
        try:
            if not hasattr(self._aead, "decrypt_into"):
                return self._aead.decrypt(nonce, bytes(data[NONCE_BYTES:]), page.aad)
            dst = out if out is not None and len(out) == n else memoryview(np.empty(n, np.uint8))
            self._aead.decrypt_into(nonce, data[NONCE_BYTES:], page.aad, dst)
        except self._invalid:
            raise CodecError("decrypt") from None
        return dst
