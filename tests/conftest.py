"""Shared fixtures: small real configs and real torch tensors (no mocks)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest
import torch

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
torch.set_num_threads(1)

from hicache import HiCacheConfig, load_config  # noqa: E402

from .fuzz import conftest as _fuzz_profiles  # noqa: E402,F401 - registers --hypothesis-profile=long

# Small geometry so page copies are cheap: 4 layers, 2 KV heads, head_dim 8, 4-token pages.
SMALL = {
    "model": {"name": "test-model", "num_layers": 4, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
    "page_size": 4,
}


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def make_config(device_pages: int = 16, host_pages: int = 64, **overrides: Any) -> HiCacheConfig:
    """A small config whose tiers hold exactly ``device_pages`` / ``host_pages`` pages."""
    cfg = _merge(SMALL, overrides)
    page_bytes = load_config(overrides=cfg, env={}).page_bytes
    cfg = _merge(
        cfg,
        {"tiers": {"device": {"capacity": device_pages * page_bytes}, "host": {"capacity": host_pages * page_bytes}}},
    )
    return load_config(overrides=cfg, env={})


@pytest.fixture
def config_factory() -> Callable[..., HiCacheConfig]:
    return make_config


def make_kv(config: HiCacheConfig, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """Random KV ``[C, L, T, H, D]`` for ``num_tokens`` tokens, deterministic per seed."""
    m = config.model
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(
        (m.kv_components, m.num_layers, num_tokens, m.num_kv_heads, m.head_dim), generator=gen
    ).to(m.torch_dtype)


def make_tokens(n: int, seed: int = 0, vocab: int = 50_000) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=gen).tolist()


# -- real servers shared by the whole session (tests keep apart by key prefix) ----------------

if TYPE_CHECKING:
    from .servers import S3Server, ServerProcess, ValkeyCluster


@pytest.fixture(scope="session")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One real valkey-server on loopback for the whole session; tests keep apart by key prefix."""
    from .servers import start_valkey

    server = start_valkey(tmp_path_factory.mktemp("valkey"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One real mooncake_master on loopback for the session; tests keep apart by key prefix."""
    from .mooncake_master import start_mooncake

    server, settings = start_mooncake(tmp_path_factory.mktemp("mooncake"))
    yield settings
    server.stop()


@pytest.fixture(scope="session")
def mooncake_holder(mooncake_cluster: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """A client that mounts a segment for the whole session, so pages outlive the caches that wrote them
    (Mooncake keeps an object in the memory of a live client; caches here mount none of their own)."""
    import anyio

    from hicache.tiers.storage.mooncake import MooncakeBackend

    holder = MooncakeBackend(**(mooncake_cluster | {"global_segment_size": 256 * 1024**2, "key_prefix": "holder"}))
    anyio.run(holder.open)
    try:
        yield mooncake_cluster
    finally:
        anyio.run(holder.aclose)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real SeaweedFS S3 gateway (``weed mini``) on loopback for the session; tests keep apart by key prefix."""
    from .servers import start_seaweedfs

    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyCluster]:
    """One real three-primary Valkey cluster on loopback for the session; tests keep apart by key prefix."""
    from .servers import start_valkey_cluster

    cluster = start_valkey_cluster(tmp_path_factory.mktemp("valkey-cluster"))
    yield cluster
    cluster.stop()
