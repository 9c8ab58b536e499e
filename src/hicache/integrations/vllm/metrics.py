"""hicache's metrics on vLLM's own ``/metrics``, through vLLM's connector stats and Prometheus hooks.

The path (vLLM 0.32): every step the worker's ``get_kv_connector_stats`` may return a
``HiCacheConnectorStats``; the model runner puts it in the step's output, the scheduler passes its
``to_dict()`` payload on in ``SchedulerStats``, and in the API server process vLLM's Prometheus
logger hands it to the ``KVConnectorPromMetrics`` that ``build_prom_metrics`` made. Here the payload
is the worker's latest export (``export.py``: hicache's metric families and the connector's,
cumulative) at most once per ``stats_interval_s``, and ``HiCachePromMetrics`` keeps the latest one
per engine and exports it, with vLLM's ``model_name`` and ``engine`` labels added, from a collector
in the process's default registry, which is what vLLM's ``/metrics`` serves.

Why a collector and not vLLM's ``metric_types`` (the Counter/Gauge/Histogram classes it passes):
hicache's latencies are fixed-bucket histograms kept by the cache, which prometheus_client's
``Histogram`` can only rebuild observation by observation; exporting the cache's own families keeps
every figure exactly what ``hicache.metrics`` exports elsewhere. What this cannot carry:

* figures while vLLM is idle: vLLM moves stats only with its steps, so writes that finish after the
  last request show on the next step (or on ``metrics_port``, which reads the cache live);
* ``--api-server-count`` above 1: vLLM then serves ``/metrics`` from prometheus_client's
  multiprocess files, which a collector does not join; use ``metrics_port`` (logged at start).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import Metric
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .export import decode

__all__ = ["HiCacheConnectorStats", "HiCachePromMetrics"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

#: the figures of vLLM's periodic "KV Transfer metrics" log line (cumulative)
_SUMMARY = {
    "hicache_vllm_loaded_tokens": "loaded_tokens",
    "hicache_vllm_failed_tokens": "recomputed_tokens",
    "hicache_vllm_saved_tokens": "saved_tokens",
    "hicache_storage_stored_pages": "storage_written_pages",
    "hicache_tier_lost_pages": "lost_pages",
}


@dataclass
class HiCacheConnectorStats(KVConnectorStats):
    """The worker's latest export: ``data = {"families": [...]}`` (cumulative, so merging keeps the newer)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            self.data = dict(other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for family in decode(self.data.get("families", [])):
            key = _SUMMARY.get(family.name)
            if key is not None:
                out[key] = out.get(key, 0) + sum(s.value for s in family.samples if s.name.endswith("_total"))
        return {k: int(v) for k, v in out.items()}

    def is_empty(self) -> bool:
        return not self.data.get("families")


class HiCachePromMetrics(KVConnectorPromMetrics):
    """Keeps each engine's latest export and serves it from a collector in the default registry."""

    _lock = threading.Lock()
    _registered: _Exporter | None = None  # one per process: a newer logger replaces the older one's

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.latest: dict[int, list[Any]] = {}
        exporter = _Exporter(self)
        with HiCachePromMetrics._lock:
            old, HiCachePromMetrics._registered = HiCachePromMetrics._registered, exporter
            if old is not None:
                REGISTRY.unregister(old)
            REGISTRY.register(exporter)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            log.warning(
                "hicache: vLLM serves /metrics from prometheus_client's multiprocess files (--api-server-count > 1): "
                "hicache's metrics are not among them; set metrics_port in kv_connector_extra_config"
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        families = transfer_stats_data.get("families") if isinstance(transfer_stats_data, dict) else None
        if families:
            self.latest[engine_idx] = families

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for engine_idx, families in sorted(self.latest.items()):
            values = self.per_engine_labelvalues.get(engine_idx, [None, str(engine_idx)])
            const = {name: str(value) for name, value in zip(self._labelnames, values)}
            for family in decode(families, const):
                if family.name in merged:  # the same family from several engines: one family, more samples
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


class _Exporter:
    """The registry's handle on ``HiCachePromMetrics`` (names are known only at scrape time)."""

    def __init__(self, metrics: HiCachePromMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return self.metrics.collect()
