"""Every kind of hicache storage tier under SGLang: a round trip through the backend's zero-copy path over
real servers started on loopback (Valkey Cluster, Mooncake, S3), a memory tier and a plugin chain."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from .harness import backend, fill, page_bytes, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")


def round_trip(storage: list[dict[str, Any]], seed: int) -> Any:
    _, host = pools("page_first")
    b = backend(host, {"interface_v1": 1, "storage": storage})
    try:
        ps = host.page_size
        tokens = tokens_for(6, ps, seed=seed)
        keys = page_hashes(tokens, ps)
        slots = host.alloc(len(tokens))
        fill(host, slots, seed=seed + 1)
        assert b.batch_set_v1(keys, slots) == [True] * 6
        assert b.batch_exists(keys) == 6
        back = host.alloc(len(tokens))
        assert b.batch_get_v1(keys, back) == [True] * 6
        assert torch.equal(page_bytes(host, back), page_bytes(host, slots))
        return b.stats()
    finally:
        b.close()


def test_valkey_cluster(valkey_cluster: Any) -> None:
    stats = round_trip([{"kind": "redis", "url": valkey_cluster.url, "cluster": True, "key_prefix": "sgl"}], seed=1)
    assert stats.storage["redis"].fetched_pages == 6


def test_mooncake(mooncake_holder: dict[str, Any]) -> None:
    entry = {**mooncake_holder, "kind": "mooncake", "global_segment_size": 0, "key_prefix": "sgl"}
    assert round_trip([entry], seed=3).storage["mooncake"].fetched_pages == 6


def test_s3(seaweedfs: Any) -> None:
    stats = round_trip([{"kind": "s3", **seaweedfs.settings(key_prefix="sgl")}], seed=5)
    assert stats.storage["s3"].fetched_pages == 6


def test_a_chain_of_tiers_reads_what_the_first_lacks(tmp_path: Path) -> None:
    """Memory over file: pages are written to both; a fresh backend (an empty memory tier) reads them
    from the file tier."""
    chain = [{"kind": "memory", "name": "near"}, {"kind": "file", "name": "far", "path": str(tmp_path)}]
    stats = round_trip(chain, seed=7)
    assert stats.storage["near"].fetched_pages == 6 and stats.storage["far"].stored_pages == 6
    stats = round_trip(chain, seed=7)  # same pages again: the memory tier is new and empty
    assert stats.storage["near"].stored_pages == 6 and stats.storage["far"].skipped_pages == 6
