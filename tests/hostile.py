"""Helpers for tests that play someone else with write access to a shared store.

An ``Attacker`` is a plain backend client of the same kind and settings as the victim's tier (what
anyone who can reach the folder or the server has): it reads and writes raw ``header + payload``
values under any name, and knows no tenant key. ``storage_names`` gives the names a config's pages
are stored under, the names a listing of the store shows.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hicache import HiCache, HiCacheConfig
from hicache.containers import geometry_from_config, namespace_from_config
from hicache.keys import as_token_bytes, chain_keys
from hicache.tiers.storage import HEADER_BYTES, PageIO, StorageBackend
from hicache.tiers.storage.page_format import PageCodec
from hicache.tiers.storage.registry import resolve_backend

__all__ = ["Attacker", "codec_of", "open_fds", "read_back", "storage_names", "tier_entry"]

KEY_A = "tenant-a-secret-key-0123456789"
KEY_B = "tenant-b-secret-key-9876543210"


def tier_entry(kind: str, *, tmp_path: Path, valkey_port: int | None = None, mooncake: dict | None = None) -> dict:
    """A ``tiers.storage`` entry of ``kind`` (file, redis, mooncake) in a place of its own."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    if kind == "file":
        return {"kind": "file", "path": str(tmp_path / f"pages-{prefix}"), "fsync": "never"}
    if kind == "redis":
        assert valkey_port is not None
        return {"kind": "redis", "url": f"redis://127.0.0.1:{valkey_port}/0", "key_prefix": prefix, "timeout_s": 5.0}
    assert mooncake is not None
    return {"kind": "mooncake", **mooncake, "key_prefix": prefix, "timeout_s": 5.0}


def codec_of(config: HiCacheConfig) -> PageCodec:
    ns = namespace_from_config(config)
    return PageCodec(ns.digest, geometry_from_config(config), ns.tenant_key)


def storage_names(config: HiCacheConfig, tokens: list[int]) -> list[bytes]:
    """The names ``config``'s cache stores the full pages of ``tokens`` under."""
    ns = namespace_from_config(config)
    keys = chain_keys(ns.digest, as_token_bytes(tokens), config.page_size)
    return codec_of(config).storage_keys(keys)


async def read_back(cache: HiCache, tokens: list[int], kv: torch.Tensor) -> int:
    """Retrieve ``tokens`` and check, bit for bit, what came back; the tokens served."""
    await cache.lookup(tokens)
    async with cache.retrieve(tokens) as view:
        await view.wait_all()
        for layer in range(kv.shape[1]):
            k, v = view.layer(layer)
            assert torch.equal(k, kv[0, layer, : view.tokens]) and torch.equal(v, kv[1, layer, : view.tokens])
        return view.tokens


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Attacker:
    """Raw access to the store behind ``entry``: read and write values under any name."""

    def __init__(self, entry: dict[str, Any], page_bytes: int) -> None:
        options = {k: v for k, v in entry.items() if k not in ("kind", "name")}
        self.backend: StorageBackend = resolve_backend(entry["kind"])(**options)
        self.page_bytes = page_bytes

    async def __aenter__(self) -> Attacker:
        await self.backend.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.backend.aclose()

    def blank(self) -> PageIO:
        return PageIO.of(np.zeros(HEADER_BYTES, np.uint8), np.zeros(self.page_bytes, np.uint8))

    async def read(self, name: bytes) -> bytes:
        """The whole value stored under ``name`` (header + payload)."""
        io = self.blank()
        assert await self.backend.get([name], [io]) == 1, f"no page under {name.hex()}"
        return bytes(io.header) + bytes(io.payload[0])

    async def write(self, name: bytes, value: bytes) -> None:
        """Store ``value`` (at least a header's size) under ``name``, replacing what is there."""
        assert len(value) >= HEADER_BYTES
        io = PageIO.of(bytearray(value[:HEADER_BYTES]), bytearray(value[HEADER_BYTES:]))
        assert await self.backend.set([name], [io]) == 1

    async def write_raw(self, name: bytes, value: bytes) -> None:
        """Store any bytes under ``name``, shorter than a header too (Mooncake: padded to one header)."""
        kind = self.backend.kind
        if kind == "file":
            path = self.backend.path_of(name)  # type: ignore[attr-defined]
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".planted")
            tmp.write_bytes(value)
            os.replace(tmp, path)
        elif kind == "redis":
            await self.backend._client.set(self.backend._key(name), value)  # type: ignore[attr-defined]
        else:
            await self.write(name, value.ljust(HEADER_BYTES, b"\0"))

    async def present(self, names: list[bytes]) -> int:
        """How many of ``names``, from the first, the store holds now (not what this client remembers)."""
        index = getattr(self.backend, "_index", None)
        if index is not None:
            index.clear()  # the file backend answers from what it wrote; ask the folder
        return await self.backend.exists(names)
