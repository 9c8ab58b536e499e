"""The backend's figures, two ways: hicache's Prometheus metrics and SGLang's own storage metrics.

* ``MetricsEndpoint``: ``metrics_port`` in the extra config serves ``hicache.metrics``' storage
  metrics (per tier: pages read, written, skipped, corrupt, failures, backend call latencies; and
  ``hicache_lookups_total``, ``..._retrieves_total``, ``..._stores_total`` for SGLang's exists, read and
  write calls) over HTTP, labelled with the rank. It runs ``prometheus_client``'s own server thread;
  each scrape takes its snapshot on the backend's event loop.
* ``sglang_storage_metrics``: what ``get_stats()`` returns to SGLang (``--enable-metrics`` with
  storage metrics): pages and GB/s of every read and write call since it last asked, SGLang's
  ``StorageMetrics``, which it turns into its ``sglang:prefetch_*`` / ``sglang:backup_*`` histograms.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from .chain import CallRecord

__all__ = ["MetricsEndpoint", "sglang_storage_metrics"]

log = logging.getLogger("hicache.sglang")


class MetricsEndpoint:
    """``GET /metrics`` on ``host:port`` for one backend (``close()`` stops it)."""

    def __init__(self, backend: Any, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, start_http_server

        from ...metrics import HiCacheCollector

        ns = backend.namespace
        labels = {"tp_rank": str(ns.tp_rank), "pp_rank": str(ns.pp_rank)}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(HiCacheCollector(backend, const_labels=labels))
        self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        log.info("hicache: metrics of TP rank %s at http://%s:%d/metrics", ns.tp_rank, host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def sglang_storage_metrics(reads: Sequence[CallRecord], writes: Sequence[CallRecord]) -> Any:
    """SGLang's ``StorageMetrics`` of these calls (calls that moved no page are left out)."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    metrics = StorageMetrics()
    for r in reads:
        if r.pages:
            metrics.prefetch_pgs.append(r.pages)
            metrics.prefetch_bandwidth.append(r.gb_per_s)
    for w in writes:
        if w.pages:
            metrics.backup_pgs.append(w.pages)
            metrics.backup_bandwidth.append(w.gb_per_s)
    return metrics
