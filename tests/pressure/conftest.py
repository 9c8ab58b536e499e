"""The pressure suite's setting: tiers just big enough, real storage backends, a busy machine.

Every test here runs beside two CPU-burning processes (``busy_machine``), against the real file
tier, a real valkey-server and a real mooncake_master (the session's servers from
``tests/conftest.py``), with pages of 16 tokens and a 3-layer, 2-head, head_dim 16 geometry.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache import HiCacheConfig, load_config
from hicache.keys import as_token_bytes, chain_keys
from hicache.tiers.storage.registry import resolve_backend

PAGE = 16
GEOMETRY = {"name": "pressure-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
PAGE_BYTES = 2 * 3 * PAGE * 2 * 16 * 4
KINDS = ["file", "redis", "mooncake"]


def pressure_config(
    device_pages: int, host_pages: int, storage: list[dict[str, Any]] | None = None, *,
    model: dict[str, Any] | None = None, **policies: Any,
) -> HiCacheConfig:
    tiers: dict[str, Any] = {"device": {"capacity": device_pages * PAGE_BYTES}, "host": {"capacity": host_pages * PAGE_BYTES}}
    if storage:
        tiers["storage"] = storage
    return load_config(
        overrides={"model": model or GEOMETRY, "page_size": PAGE, "tiers": tiers, "policies": policies,
                   "controller": {"shutdown_timeout_s": 60}},
        env={},
    )


def make_kv(num_tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, num_tokens, 2, 16), generator=gen)


def make_tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (n,), generator=gen).tolist()


def page_keys(seed: bytes, tokens: list[int]) -> list[bytes]:
    return chain_keys(seed, as_token_bytes(tokens), PAGE)


@dataclass
class Storage:
    """One real storage tier for a test: its YAML entry, and a way to count what it holds."""

    kind: str
    entry: dict[str, Any]
    folder: Path | None = None

    def slowed(self, delay_s: float = 0.003, per_page_s: float = 0.0005) -> dict[str, Any]:
        """The same tier behind a slow link (``tests.fakes.DelayingStorageBackend``)."""
        inner = {k: v for k, v in self.entry.items() if k != "name"}
        return {"kind": "tests.fakes:DelayingStorageBackend", "name": self.entry["name"], "inner": inner,
                "delay_s": delay_s, "per_page_s": per_page_s}

    async def count(self, keys: list[bytes]) -> int:
        """How many of ``keys`` the tier holds, asked one by one through a fresh client of the same store."""
        options = {k: v for k, v in self.entry.items() if k not in ("name", "kind")}
        if self.kind == "mooncake":
            options["global_segment_size"] = 0  # a pure client: its exit takes no pages with it
        async with resolve_backend(self.kind)(**options) as backend:
            return sum([await backend.exists([k]) for k in keys])

    def files(self) -> int:
        assert self.folder is not None
        return sum(1 for _ in self.folder.glob("*/*.kv"))


@pytest.fixture(params=KINDS)
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    prefix = f"p{uuid.uuid4().hex[:12]}"
    if request.param == "file":
        folder = tmp_path / "pages"
        return Storage("file", {"kind": "file", "name": "store", "path": str(folder), "fsync": "never"}, folder)
    if request.param == "redis":
        server = request.getfixturevalue("valkey")
        return Storage("redis", {"kind": "redis", "name": "store", "url": f"redis://127.0.0.1:{server.port}/0",
                                 "key_prefix": prefix, "timeout_s": 5.0})
    settings = request.getfixturevalue("mooncake_holder")
    return Storage("mooncake", {"kind": "mooncake", "name": "store", **settings, "key_prefix": prefix,
                                "global_segment_size": 0, "timeout_s": 5.0})


@pytest.fixture(scope="package", autouse=True)
def busy_machine() -> Iterator[None]:
    """Two processes burning a core each, beside every pressure test (the machine is shared)."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
