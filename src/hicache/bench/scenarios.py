"""The configurations every benchmark compares, on the same trace.

* ``no-cache``: every prompt is prefilled in full.
* ``oracle``: no cache; each request starts from the longest page-aligned prefix whose KV was
  computed earlier in the run, put in place while the clock is stopped (``oracle.py``): the limit.
* ``device-only``: the device tier alone (no host, no storage): the RadixAttention baseline.
* ``memory``: device + host tiers, no storage.
* ``hierarchical``: device + host + file tier.
* ``warm-restart``: ``hierarchical``'s config in a fresh process that finds only the file tier
  the ``hierarchical`` run left.
* ``lossy``: ``hierarchical`` with the 8-bit codec (``codec: [int8]``) on its file tier, in a
  folder of its own: what quantised KV from storage does to the outputs (greedy agreement with
  ``no-cache``, first-token logit differences: ``hicache bench`` prints them when both run).

The device holds ``device_fraction`` (25%) of the workload's KV, as in production, where the
history outgrows GPU memory; the host ``host_fraction`` (50%); the file tier all of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import HiCacheConfig
from ..containers import load_config
from ..integrations.transformers import model_overrides

__all__ = [
    "CONFIGURATIONS", "DEFAULT_CONFIGURATIONS", "UNCACHED", "Sizing", "cache_config", "device_tokens", "lossy_pages_dir",
]

CONFIGURATIONS = ("no-cache", "oracle", "device-only", "memory", "hierarchical", "warm-restart", "lossy")
DEFAULT_CONFIGURATIONS = ("no-cache", "oracle", "device-only", "hierarchical", "warm-restart")
UNCACHED = ("no-cache", "oracle")  # configurations without hicache


@dataclass(frozen=True)
class Sizing:
    device_fraction: float = 0.25
    host_fraction: float = 0.5
    storage_fraction: float = 4.0  # the file tier's capacity: room for everything, several times over


def lossy_pages_dir(pages_dir: str) -> str:
    """The ``lossy`` configuration's file tier: beside ``hierarchical``'s, never mixed with it."""
    return pages_dir.rstrip("/") + "-lossy"


def device_tokens(kv_tokens: int, sizing: Sizing, page_size: int) -> int:
    """Tokens of KV the device tier holds: also the engine's KV budget, in every configuration."""
    return max(1, math.ceil(kv_tokens * sizing.device_fraction / page_size)) * page_size


def cache_config(
    name: str, model: Any, kv_tokens: int, sizing: Sizing, base: str | None, pages_dir: str
) -> HiCacheConfig | None:
    """The cache config of configuration ``name`` for a workload computing ``kv_tokens`` of KV."""
    if name not in CONFIGURATIONS:
        raise ValueError(f"unknown configuration {name!r}; choose from {', '.join(CONFIGURATIONS)}")
    if name in UNCACHED:
        return None
    env = {"HICACHE_BENCH_PAGES": pages_dir}
    probe = load_config(base, overrides=model_overrides(model, fingerprint=False), env=env)

    def pages(fraction: float) -> int:
        """Bytes of whole pages holding ``fraction`` of the workload's KV (as ``device_tokens`` counts)."""
        return max(1, math.ceil(kv_tokens * fraction / probe.page_size)) * probe.page_bytes

    tiers: dict[str, Any] = {"device": {"capacity": pages(sizing.device_fraction)}}
    if name == "device-only":
        tiers |= {"host": {"capacity": 0}, "storage": []}
    elif name == "memory":
        tiers |= {"host": {"capacity": pages(sizing.host_fraction)}, "storage": []}
    else:
        storage = [dict(t.model_dump(mode="json", exclude_none=True)) for t in probe.tiers.storage]
        for tier in storage:
            if tier["kind"] == "file":
                tier["capacity"] = pages(sizing.storage_fraction)
                if name == "lossy":
                    tier["codec"] = ["int8"]
                    tier["path"] = lossy_pages_dir(pages_dir)
        tiers |= {"host": {"capacity": pages(sizing.host_fraction)}, "storage": storage}
    overrides = model_overrides(model) | {"tiers": tiers}
    return load_config(base, overrides=overrides, env=env)
