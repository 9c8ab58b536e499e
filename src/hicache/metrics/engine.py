"""``EngineMetrics``: per-request figures of the reference engine (``hicache.engine.Engine``).

TTFT, inter-token latency, queue time and cached tokens are observed once per finished request
(``Engine(..., on_result=metrics.observe)``); request counts and the queue are read from
``engine.stats()`` at scrape time (``metrics.bind(engine)``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from ..engine import Engine
    from ..engine.request import RequestResult

__all__ = ["EngineMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKENS = (0, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class EngineMetrics:
    """Histograms and counters of finished requests, in ``registry`` (a new one by default)."""

    def __init__(self, registry: CollectorRegistry | None = None, *, prefix: str = "hicache_engine") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r, p = self.registry, prefix
        self.ttft = Histogram(f"{p}_ttft_seconds", "Time to first token, from arrival (queueing included)", buckets=_SECONDS, registry=r)
        self.itl = Histogram(f"{p}_itl_seconds", "Gaps between consecutive output tokens", buckets=_SECONDS, registry=r)
        self.queue = Histogram(f"{p}_queue_seconds", "From arrival to admission", buckets=_SECONDS, registry=r)
        self.cached = Histogram(f"{p}_cached_tokens", "Prompt tokens restored from the cache, per request", buckets=_TOKENS, registry=r)
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(
            f"{p}_cached_tokens_by_tier", "Prompt tokens restored, by the tier that held them", ["tier"], registry=r
        )
        self.output_tokens = Counter(f"{p}_output_tokens", "Tokens generated", registry=r)
        self._prefix = prefix
        self._engine: Engine | None = None

    def observe(self, result: RequestResult) -> None:
        """Record one finished request (pass as ``Engine(on_result=...)``)."""
        self.ttft.observe(result.ttft_s)
        self.queue.observe(result.queue_s)
        for gap in result.itl_s:
            self.itl.observe(gap)
        self.cached.observe(result.cached_tokens)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.output_tokens.inc(len(result.output))
        for tier, tokens in result.by_tier.items():
            if tokens:
                self.cached_tokens.labels(tier).inc(tokens)

    def bind(self, engine: Engine) -> EngineMetrics:
        """Also export ``engine``'s request counts and queue (read at scrape time)."""
        if self._engine is None:
            self.registry.register(_EngineCollector(self, self._prefix))
        self._engine = engine
        return self


class _EngineCollector(Collector):
    def __init__(self, metrics: EngineMetrics, prefix: str) -> None:
        self.metrics = metrics
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        engine = self.metrics._engine
        if engine is None:
            return
        s = engine.stats()
        requests = CounterMetricFamily(f"{self.prefix}_requests", "Requests by outcome", labels=["outcome"])
        for outcome, n in (("submitted", s.submitted), ("finished", s.finished), ("failed", s.failed), ("cancelled", s.cancelled)):
            requests.add_metric([outcome], n)
        yield requests
        state = GaugeMetricFamily(f"{self.prefix}_requests_now", "Requests waiting or running now", labels=["state"])
        state.add_metric(["waiting"], s.waiting)
        state.add_metric(["running"], s.running)
        yield state
