"""One configuration of a serving benchmark: a workload driven over HTTP against a ``ServerSet``.

``run_workload`` warms the servers up (one short request), takes the connectors' counters, drives
the conversations through ``driver.drive`` with streaming clients (``openai_client``), then collects
what the servers say: each server's Prometheus scrape (vLLM's ``/metrics``, with hicache's families
when the connector runs; and the connector worker's own live ``/metrics``), the connector's
counters, profile and per-request load records, which split each request's cached tokens into
vLLM's own prefix cache and the hicache tiers that supplied the rest. It knows nothing of how the
servers were configured: a prefill/decode pair behind a proxy runs through it unchanged.
"""

from __future__ import annotations

import math
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

from ..engine import Request
from .driver import DriverSettings, drive
from .openai_client import CompletionsClient, request_id
from .vllm_server import ServerSet
from .workloads import Conversation

__all__ = ["run_workload", "split_by_tier"]

_WARM_UP_TOKENS = 64


def _warm_up_prompt(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed ^ 0x5EED)
    return [rng.randrange(100, vocab) for _ in range(_WARM_UP_TOKENS)]


async def _drive(servers: ServerSet, conversations: list[Conversation], settings: DriverSettings, *, vocab: int,
                 id_prefix: str, progress: bool, label: str) -> tuple[list[Any], float]:
    total = sum(len(c.chunks) for c in conversations)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"{label:>22}", unit="req", file=sys.stderr)
    clients = max(8, 2 * settings.max_parallel)
    async with CompletionsClient(servers.url, servers.model, id_prefix=id_prefix, max_connections=clients) as client:
        warm = Request(_warm_up_prompt(settings.seed, vocab), 2, tags={"conversation": "warm", "round": 0})
        await client.generate(warm)
        for server in servers.servers:  # the warm-up's pages are saved before the clock starts
            await anyio.to_thread.run_sync(server.channel_call, {"op": "wait_idle", "timeout_s": 120})
        started = time.perf_counter()
        try:
            records = await drive(client, conversations, settings, on_done=(lambda _r: bar.update(1)) if bar else None)
        finally:
            if bar is not None:
                bar.close()
        return records, time.perf_counter() - started


def split_by_tier(records: list[dict[str, Any]], loads: dict[str, dict[str, Any]], id_prefix: str) -> None:
    """Fill each record's ``by_tier``: what the connector loaded for it, by tier, and the rest of its
    cached tokens as vLLM's own prefix cache's (``loads``: the connectors' per-request records)."""
    for r in records:
        rid = request_id(id_prefix, {"conversation": r["conversation"], "round": r["round"]})
        mine = [v for k, v in loads.items() if rid in k]  # vLLM's request id embeds the X-Request-Id
        loaded = sum(int(v["loaded_tokens"]) for v in mine)
        tiers: dict[str, int] = {}
        for v in mine:
            for tier, n in v["by_tier"].items():
                tiers[tier] = tiers.get(tier, 0) + int(n)
        r["by_tier"] = {"vllm": max(int(r["cached_tokens"]) - loaded, 0)} | tiers
        r["failed_tokens"] = sum(int(v.get("failed_tokens", 0)) for v in mine)


def run_workload(
    servers: ServerSet,
    conversations: list[Conversation],
    settings: DriverSettings,
    *,
    out: Path,
    label: str,
    vocab: int,
    progress: bool = True,
    id_prefix: str = "hcb-",
) -> dict[str, Any]:
    """Drive ``conversations`` against the running ``servers``; the run's records and what the servers said.

    Writes each server's scrapes as ``metrics-{label}[-{server}].prom`` (and the connector worker's
    live ``/metrics`` as ``...-worker.prom``) into ``out``.
    """
    before = {s.name: s.channel_call({"op": "stats"}) for s in servers.servers}
    records, wall = anyio.run(lambda: _drive(servers, conversations, settings, vocab=vocab, id_prefix=id_prefix,
                                             progress=progress, label=label))
    rows = [asdict(r) for r in records]
    stats: dict[str, Any] = {}
    loads: dict[str, dict[str, Any]] = {}
    scrapes: dict[str, str] = {}
    for s in servers.servers:
        s.channel_call({"op": "wait_idle", "timeout_s": 120})
        now = s.channel_call({"op": "stats"})
        suffix = "" if len(servers.servers) == 1 else f"-{s.name}"
        path = out / f"metrics-{label}{suffix}.prom"
        path.write_text(s.scrape())
        scrapes[s.name] = str(path)
        if now is None:
            continue
        seen = set((before.get(s.name) or {}).get("requests", {}))
        loads.update({k: v for k, v in now.get("requests", {}).items() if k not in seen})
        stats[s.name] = _since(now, before.get(s.name))
        if now.get("metrics_url"):
            live = out / f"metrics-{label}{suffix}-worker.prom"
            import urllib.request

            with urllib.request.urlopen(now["metrics_url"], timeout=60) as resp:
                live.write_bytes(resp.read())
            scrapes[f"{s.name}-worker"] = str(live)
    split_by_tier(rows, loads, id_prefix)
    return {
        "configuration": label,
        "wall_s": wall,
        "records": rows,
        "cache_stats": next(iter(stats.values()), None) if len(stats) == 1 else stats or None,
        "scrapes": scrapes,
        "servers": {s.name: {"url": s.url, "log": str(s.log), "start_s": s.started_s} for s in servers.servers},
    }


def _since(now: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The connector's counters and profile over the run (the warm-up's taken off); the rest as now."""
    if not before:
        return now
    out = dict(now)
    out["connector"] = _minus(now.get("connector") or {}, before.get("connector") or {})
    out["profile"] = _minus(now.get("profile") or {}, before.get("profile") or {})
    if now.get("loop_cpu_s") is not None and before.get("loop_cpu_s") is not None:
        out["loop_cpu_s"] = now["loop_cpu_s"] - before["loop_cpu_s"]
    return out


def _minus(a: Any, b: Any) -> Any:
    if isinstance(a, dict):
        return {k: _minus(v, (b or {}).get(k) if isinstance(b, dict) else None) for k, v in a.items()}
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_minus(x, y) for x, y in zip(a, b)]
    if isinstance(a, int | float) and not isinstance(a, bool) and isinstance(b, int | float) and not isinstance(b, bool):
        value = a - b
        return value if not isinstance(value, float) or math.isfinite(value) else a
    return a
