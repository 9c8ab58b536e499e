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
from ..containers import load_config
from ..engine import Engine
from ..integrations.transformers import CachedCausalLM
from .driver import DriverSettings, drive
from .models import load_model
from .oracle import OracleLM
from .profiling import ActivityTrace, cpu_pressure, install_trace, process_times, thread_times, torch_profile
from .scenarios import Sizing, cache_config, device_tokens, lossy_pages_dir
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
    interleave: list[str] = field(default_factory=list)  # these configurations in one process, taking turns
    first_logits: bool = False  # save each request's first-token logits to ``first-logits-<configuration>.pt``

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


@dataclass
class _Setup:
    """What every configuration of a run shares: the model, the trace and the sizes."""

    model: Any
    vocab: int
    workload: MultiTurn | LongContext
    page_size: int
    kv_budget: int
    driver: DriverSettings

    @classmethod
    def of(cls, spec: RunSpec) -> _Setup:
        model = load_model(spec.model, seed=spec.seed)
        vocab = model.config.get_text_config().vocab_size
        workload = spec.make_workload()
        page_size = load_config(spec.config_path, env={"HICACHE_BENCH_PAGES": spec.pages_dir}).page_size
        kv_budget = device_tokens(workload.kv_tokens(), Sizing(**spec.sizing), page_size)
        _warm_up(model, vocab)
        return cls(model, vocab, workload, page_size, kv_budget, DriverSettings(**{**spec.driver, "page_size": page_size}))

    def cache_config(self, spec: RunSpec, name: str) -> Any:
        if name == "hierarchical":
            shutil.rmtree(spec.pages_dir, ignore_errors=True)  # starts cold; warm-restart then finds it
        if name == "lossy":
            shutil.rmtree(lossy_pages_dir(spec.pages_dir), ignore_errors=True)
        return cache_config(name, self.model, self.workload.kv_tokens(), Sizing(**spec.sizing), spec.config_path,
                            spec.pages_dir)

    def language_model(self, spec: RunSpec, name: str, cache: HiCache | None) -> tuple[Any, OracleLM | None]:
        """The configuration's LM (the oracle's, or ``CachedCausalLM`` over ``cache``, ``None``: no cache)."""
        if name == "oracle":
            oracle = OracleLM(self.model, self.page_size, expected_tokens=self.workload.kv_tokens())
            return oracle, oracle
        return CachedCausalLM(self.model, cache, yield_to_prefills=spec.yield_to_prefills), None

    def engine(self, spec: RunSpec, lm: Any, oracle: OracleLM | None, on_result: Any = None) -> Engine:
        clock, cpu_clock = (oracle.clock, oracle.cpu_clock) if oracle is not None else (time.monotonic, time.process_time)
        return Engine(lm, max_running=spec.max_running, max_kv_tokens=self.kv_budget, clock=clock,
                      cpu_clock=cpu_clock, on_result=on_result)


async def run_configuration(spec: RunSpec) -> dict[str, Any]:
    setup = _Setup.of(spec)
    conversations = setup.workload.conversations(setup.vocab)
    config = setup.cache_config(spec, spec.configuration)
    bar = _progress(spec, spec.configuration, setup.workload.requests)

    def on_done(record: Any) -> None:
        if bar is not None:
            bar.update(1)

    oracle: OracleLM | None = None

    exporter = _MetricsExport(spec) if spec.metrics else None

    tap = FirstLogits() if spec.first_logits else None

    async def serve(cache: HiCache | None) -> tuple[list[Any], float]:
        nonlocal oracle
        lm, oracle = setup.language_model(spec, spec.configuration, cache)
        if tap is not None:
            lm = tap.wrap(lm)
        started = time.perf_counter()
        on_result = None
        if exporter is not None:
            exporter.attach(cache)
            on_result = exporter.engine.observe
        async with setup.engine(spec, lm, oracle, on_result) as engine:
            if exporter is not None:
                exporter.engine.bind(engine)
            records = await drive(engine, conversations, setup.driver, on_done)
        return records, time.perf_counter() - started

    stats: Any = None
    machine = _machine_before()
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
    _machine_after(machine, times)
    if bar is not None:
        bar.close()
    if tap is not None:
        tap.save(Path(spec.out_dir) / f"first-logits-{spec.configuration}.pt")
    return {
        "configuration": spec.configuration,
        "wall_s": wall,
        "records": [dataclasses.asdict(r) for r in records],
        "cache_config": None if config is None else config.model_dump(mode="json"),
        "cache_stats": _jsonable(stats),
        "machine": machine,
        "oracle": _oracle_figures(oracle),
        "profile": {"torch": profile.result, "activity": trace.summary()} if spec.profile else None,
    }


class FirstLogits:
    """Keeps each request's first-token logits (the prefill's last position), by prompt.

    Wraps a language model's ``sequence``: after ``prefill`` it copies ``seq.logits``. Keyed by a
    hash of the prompt's tokens, so two configurations' logits are compared only where their
    prompts are the same (a multi-turn prompt holds the earlier outputs).
    """

    def __init__(self) -> None:
        self.logits: dict[str, torch.Tensor] = {}

    def wrap(self, lm: Any) -> Any:
        from contextlib import asynccontextmanager

        tap = self

        class Tapped:
            def __getattr__(self, name: str) -> Any:
                return getattr(lm, name)

            @asynccontextmanager
            async def sequence(self, tokens: Any, **kwargs: Any) -> Any:
                async with lm.sequence(tokens, **kwargs) as seq:
                    yield _TappedSequence(seq, tap, tokens)

        return Tapped()

    def save(self, path: Path) -> None:
        torch.save(self.logits, path)


class _TappedSequence:
    def __init__(self, seq: Any, tap: FirstLogits, tokens: Any) -> None:
        self._seq, self._tap = seq, tap
        import hashlib

        self._key = hashlib.blake2b(torch.as_tensor(list(tokens), dtype=torch.int64).numpy().tobytes(),
                                    digest_size=16).hexdigest()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._seq, name)

    async def prefill(self) -> int:
        token = await self._seq.prefill()
        if getattr(self._seq, "logits", None) is not None:
            self._tap.logits[self._key] = self._seq.logits.detach().float().clone()
        return token


async def run_interleaved(spec: RunSpec) -> dict[str, dict[str, Any]]:
    """``spec.interleave``'s configurations in this process, taking turns request by request
    (``interleave.py``); one result per configuration, shaped as ``run_configuration``'s."""
    from contextlib import AsyncExitStack

    from .interleave import serve_interleaved

    setup = _Setup.of(spec)
    names = list(spec.interleave)
    configs = {name: setup.cache_config(spec, name) for name in names}
    oracles: dict[str, OracleLM | None] = {}
    stats: dict[str, Any] = {}
    bars = {name: _progress(spec, name, setup.workload.requests) for name in names}

    async def open_engine(name: str, stack: AsyncExitStack) -> tuple[Engine, Any]:
        config = configs[name]
        cache = None if config is None else await stack.enter_async_context(HiCache.from_config(config))
        lm, oracles[name] = setup.language_model(spec, name, cache)
        engine = await stack.enter_async_context(setup.engine(spec, lm, oracles[name]))
        if cache is None:
            return engine, None
        stack.push_async_callback(_keep_stats, cache, name, stats)  # runs first on exit: every request done
        return engine, cache.wait_idle

    async def drive_one(name: str, engine: Any) -> list[Any]:
        bar = bars[name]
        return await drive(engine, setup.workload.conversations(setup.vocab), setup.driver,
                           (lambda _r: bar.update(1)) if bar is not None else None)

    machine = _machine_before()
    times = process_times()
    served = await serve_interleaved(names, open_engine, drive_one)
    _machine_after(machine, times)
    for bar in bars.values():
        if bar is not None:
            bar.close()
    return {
        name: {
            "configuration": name,
            "wall_s": served[name].busy_s,  # its own turns: as if it had run alone
            "drain_s": served[name].drain_s,
            "turn_started_s": served[name].turn_started_s,
            "records": [dataclasses.asdict(r) for r in served[name].records],
            "cache_config": None if configs[name] is None else configs[name].model_dump(mode="json"),
            "cache_stats": _jsonable(stats.get(name)),
            "machine": machine,
            "oracle": _oracle_figures(oracles.get(name)),
            "profile": None,
            "interleaved_with": names,
        }
        for name in names
    }


async def _keep_stats(cache: HiCache, name: str, into: dict[str, Any]) -> None:
    await cache.wait_idle()
    into[name] = cache.stats()


def _machine_before() -> dict[str, Any]:
    return {
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_pressure_before": cpu_pressure(),
    }


def _machine_after(machine: dict[str, Any], times: dict[str, float]) -> None:
    machine["cpu_pressure_after"] = cpu_pressure()
    machine["thread_cpu_s"] = thread_times()
    machine["process_cpu_s"] = {k: v - times[k] for k, v in process_times().items()}


def _oracle_figures(oracle: OracleLM | None) -> dict[str, Any] | None:
    return None if oracle is None else {"kept_bytes": oracle.kept_bytes, "clock_stopped_s": oracle.clock.stopped_s}


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


def _progress(spec: RunSpec, name: str, total: int) -> Any:
    if not spec.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{name:>13}", unit="req", file=sys.stderr, dynamic_ncols=True)


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
    result = anyio.run(run_interleaved if spec.interleave else run_configuration, spec)
    Path(argv[0]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
