"""Prometheus metrics for hicache (the ``metrics`` extra: ``pip install 'hicache[metrics]'``).

    from hicache.metrics import HiCacheCollector, serve

    registry.register(HiCacheCollector(cache))          # into an engine's own registry, or:
    async with serve(cache, port=9400) as server:       # /metrics (and /admin/... with admin=True)
        ...

Every figure is read from ``HiCache.stats()`` at scrape time; ``METRICS`` lists them (docs/operating.md
has the list and example queries). ``EngineMetrics`` adds the reference
engine's per-request TTFT, inter-token latency, queue time and cached tokens.
"""

from .collector import METRICS, HiCacheCollector
from .engine import EngineMetrics
from .server import MetricsServer, registry_for, serve

__all__ = ["METRICS", "EngineMetrics", "HiCacheCollector", "MetricsServer", "registry_for", "serve"]
