"""Runs one configuration of a benchmark in this process: ``python -m hicache.bench.worker OUT.json``.

The parent (``hicache bench ...``) starts one such process per configuration, so each starts
cold, as ``warm-restart`` must, and none inherits another's memory or threads. The run's
settings arrive as JSON on stdin; the records and the cache's stats go to ``OUT.json``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import MappingProxyType
from typing import Any

import anyio
import torch

from ..cache import HiCache
from ..config import load_config
from ..engine import Engine
from ..integrations.transformers import CachedCausalLM
from .driver import DriverSettings, drive
from .models import load_model
from .oracle import OracleLM
from .profiling import ActivityTrace, cpu_pressure, install_trace, process_times, thread_times, torch_profile
from .scenarios import Sizing, cache_config, device_tokens
from .workloads import LongContext, MultiTurn

__all__ = ["RunSpec", "run_configuration"]


@dataclass(frozen=True)
class RunSpec:
    """Everything one configuration's run needs (JSON-serialisable)."""

    benchmark: str  # "multiturn" | "long-context"
    workload: dict[str, Any]
    configuration: str
    out_dir: str
    model: str = "random"
    seed: int = 0
    driver: dict[str, Any] = field(default_factory=dict)
    sizing: dict[str, Any] = field(default_factory=dict)
    config_path: str | None = None
    max_running: int = 4
    progress: bool = True
    profile: bool = False  # torch.profiler over the run: the top operators go into the result
    yield_to_prefills: bool = True  # the cache's background work waits while a prefill computes
    metrics: bool = False  # write the run's Prometheus metrics to ``metrics-<configuration>.prom``

    def make_workload(self) -> MultiTurn | LongContext:
        kind = MultiTurn if self.benchmark == "multiturn" else LongContext
        return kind(**self.workload)

    @property
    def pages_dir(self) -> str:
        return os.path.join(self.out_dir, "pages")


def _warm_up(model: Any, vocab: int) -> None:
    """One short forward, so lazy initialisation is not billed to the first request."""
    with torch.inference_mode():
        model(input_ids=torch.arange(100, 164).remainder(vocab).unsqueeze(0), use_cache=False, logits_to_keep=1)


async def run_configuration(spec: RunSpec) -> dict[str, Any]:
    model = load_model(spec.model, seed=spec.seed)
    vocab = model.config.get_text_config().vocab_size
    workload = spec.make_workload()
    conversations = workload.conversations(vocab)
    if spec.configuration == "hierarchical":
        shutil.rmtree(spec.pages_dir, ignore_errors=True)  # starts cold; warm-restart then finds it
    config = cache_config(
        spec.configuration,
        model,
        workload.kv_tokens(),
        Sizing(**spec.sizing),
        spec.config_path,
        spec.pages_dir,
    )
    page_size = load_config(spec.config_path, env={"HICACHE_BENCH_PAGES": spec.pages_dir}).page_size
    kv_budget = device_tokens(workload.kv_tokens(), Sizing(**spec.sizing), page_size)
    _warm_up(model, vocab)
    driver = DriverSettings(**{**spec.driver, "page_size": page_size})
    bar = _progress(spec, workload.requests)

    def on_done(record: Any) -> None:
        if bar is not None:
            bar.update(1)

    oracle: OracleLM | None = None

    exporter = _MetricsExport(spec) if spec.metrics else None

    async def serve(cache: HiCache | None) -> tuple[list[Any], float]:
        nonlocal oracle
        if spec.configuration == "oracle":
            oracle = OracleLM(model, page_size, expected_tokens=workload.kv_tokens())
            lm: Any = oracle
            clock, cpu_clock = oracle.clock, oracle.cpu_clock
        else:
            lm = CachedCausalLM(model, cache, yield_to_prefills=spec.yield_to_prefills)
            clock, cpu_clock = time.monotonic, time.process_time
        started = time.perf_counter()
        on_result = None
        if exporter is not None:
            exporter.attach(cache)
            on_result = exporter.engine.observe
        async with Engine(lm, max_running=spec.max_running, max_kv_tokens=kv_budget, clock=clock,
                          cpu_clock=cpu_clock, on_result=on_result) as engine:
            if exporter is not None:
                exporter.engine.bind(engine)
            records = await drive(engine, conversations, driver, on_done)
        return records, time.perf_counter() - started

    stats: Any = None
    machine: dict[str, Any] = {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_pressure_before": cpu_pressure(),
    }
    trace = ActivityTrace()
    if spec.profile:
        install_trace(trace)
    times = process_times()
    with torch_profile(spec.profile) as profile:
        if config is None:
            records, wall = await serve(None)
            if exporter is not None:
                exporter.write()
        else:
            async with HiCache.from_config(config) as cache:
                records, wall = await serve(cache)
                await cache.wait_idle()  # every backup lands in the file tier before the process ends
                stats = cache.stats()
                if exporter is not None:
                    exporter.write()  # scraped while the cache is open: its final figures
    machine["cpu_pressure_after"] = cpu_pressure()
    machine["thread_cpu_s"] = thread_times()
    machine["process_cpu_s"] = {k: v - times[k] for k, v in process_times().items()}
    if bar is not None:
        bar.close()
    return {
        "configuration": spec.configuration,
        "wall_s": wall,
        "records": [dataclasses.asdict(r) for r in records],
        "cache_config": None if config is None else config.model_dump(mode="json"),
        "cache_stats": _jsonable(stats),
        "machine": machine,
        "oracle": None if oracle is None else {"kept_bytes": oracle.kept_bytes, "clock_stopped_s": oracle.clock.stopped_s},
        "profile": {"torch": profile.result, "activity": trace.summary()} if spec.profile else None,
    }


class _MetricsExport:
    """The run's metrics (``hicache.metrics``), written once in the exposition format at its end."""

    def __init__(self, spec: RunSpec) -> None:
        from prometheus_client import CollectorRegistry

        from ..metrics import EngineMetrics

        self.path = Path(spec.out_dir) / f"metrics-{spec.configuration}.prom"
        self.registry = CollectorRegistry(auto_describe=False)
        self.engine = EngineMetrics(self.registry)

    def attach(self, cache: HiCache | None) -> None:
        if cache is not None:
            from ..metrics import HiCacheCollector

            self.registry.register(HiCacheCollector(cache))

    def write(self) -> None:
        from prometheus_client import generate_latest

        self.path.write_bytes(generate_latest(self.registry))


def _progress(spec: RunSpec, total: int) -> Any:
    if not spec.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{spec.configuration:>13}", unit="req", file=sys.stderr, dynamic_ncols=True)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict | MappingProxyType):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hicache.bench.worker OUT.json < spec.json", file=sys.stderr)
        return 2
    spec = RunSpec(**json.loads(sys.stdin.read()))
    result = anyio.run(run_configuration, spec)
    Path(argv[0]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
