"""hicache as the storage backend (L3) of SGLang HiCache.

Launch SGLang with its dynamic backend pointing here::

    python -m sglang.launch_server --model-path M --enable-hierarchical-cache \\
        --hicache-mem-layout page_first_direct --hicache-io-backend direct \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "hicache",
            "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStorageBackend",
            "interface_v1": 1, "config": "/etc/hicache/sglang.yaml"}'

or with the storage entries inline (``"storage": [{"kind": "file", "path": "/mnt/kv"}]``). Every
storage tier hicache has works (file, Valkey/Redis and Cluster, Mooncake, S3, memory, plugins), with
its page verification, tenant key, capacity and metrics. The settings are in ``settings.py``, the
interface in ``backend.py``; SGLang's host layouts in ``host_pages.py``.

Importing this package imports SGLang (the backend subclasses SGLang's ``HiCacheStorage``).
"""

from __future__ import annotations

from .backend import HiCacheStorageBackend

__all__ = ["HiCacheStorageBackend"]
