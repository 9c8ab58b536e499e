"""Where ``vllm+hicache``'s time goes: the connector's step profile and its TTFT against the limit's.

The connector times every hook it runs on vLLM's critical path (``integrations/vllm/profile.py``);
``step_profile`` turns one run's profile (from the worker's ``stats``) into milliseconds per request:
the scheduler's lookups (a channel round trip each), its step plans, the worker's leases (``bind``),
the wait for pages that only storage held to reach the host tier (``load_wait``), the copies into
vLLM's blocks (``load``) and out of them (``save``), the step's end (``commit``).

``ttft_breakdown`` splits the gap between a configuration's mean TTFT and the limit's
(``vllm-unbounded``: everything a hit in vLLM's own prefix cache) into

* ``queue``: the difference in mean time queued in vLLM (scheduled minus arrived);
* ``connector``: the connector's hooks on the critical path, per request (all of a request's steps:
  an upper bound for what precedes its first token);
* ``recompute``: the extra prompt tokens computed per request (prompt minus cached), at the cost per
  computed token fitted over the uncached configurations' prefills (``prefill = a + b * computed``);
* ``other``: the rest (contention with the cache's background work: storage reads and writes on
  the same cores; noise).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CRITICAL_HOOKS", "fit_prefill_cost", "format_breakdown", "format_step_profile", "merge_stats",
           "step_profile", "ttft_breakdown"]

#: hooks on vLLM's critical path, by side (``worker.catch_up`` runs inside ``scheduler.lookup``)
CRITICAL_HOOKS = {
    "scheduler": ("lookup", "plan", "finish"),
    "worker": ("bind", "load_wait", "load", "save", "commit", "stats"),
}


def merge_stats(runs: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Several runs' connector stats as one: profiles, counters and the loop's CPU summed; the rest the last run's."""
    runs = [r for r in runs if r]
    if not runs:
        return None
    out = dict(runs[-1])

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {k: add(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [add(x, y) for x, y in zip(a, b)]
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
            return a + b
        return a if b is None else b

    for key in ("profile", "connector"):
        merged: Any = {}
        for r in runs:
            merged = add(merged, r.get(key) or {})
        out[key] = merged
    out["loop_cpu_s"] = sum(r.get("loop_cpu_s") or 0.0 for r in runs)
    cache = dict(out.get("cache") or {})
    cache["short_retrieves"] = sum((r.get("cache") or {}).get("short_retrieves", 0) for r in runs)
    out["cache"] = cache
    return out


def step_profile(stats: dict[str, Any] | None, requests: int) -> dict[str, Any]:
    """The connector's profile of one run, per request; ``{}`` without stats."""
    if not stats or not requests:
        return {}
    hooks: dict[str, dict[str, float]] = {}
    critical = 0.0
    for side, profile in (stats.get("profile") or {}).items():
        for hook, (calls, seconds) in profile.items():
            ms = seconds * 1e3 / requests
            hooks[f"{side}.{hook}"] = {"calls": calls / requests, "ms": ms}
            if hook in CRITICAL_HOOKS.get(side, ()):
                critical += ms
    c = stats.get("connector") or {}
    cache = stats.get("cache") or {}
    return {
        "requests": requests,
        "hooks_per_request": dict(sorted(hooks.items())),
        "critical_path_ms_per_request": critical,
        "loop_cpu_ms_per_request": (stats.get("loop_cpu_s") or 0.0) * 1e3 / requests,
        "loads": c.get("loads", 0),
        "loaded_tokens": c.get("loaded_tokens", 0),
        "loaded_by_tier": c.get("loaded_by_tier", {}),
        "loads_cut_short": c.get("load_failures", 0),
        "tokens_recomputed": c.get("failed_tokens", 0),
        "saved_tokens": c.get("saved_tokens", 0),
        "save_skipped_pages": c.get("save_skipped_pages", 0),
        "short_retrieves": cache.get("short_retrieves", 0),
    }


def _computed(record: dict[str, Any]) -> int:
    return int(record["prompt_tokens"]) - int(record["cached_tokens"])


def fit_prefill_cost(records: list[dict[str, Any]]) -> tuple[float, float] | None:
    """``(a, b)``: seconds of a prefill as ``a + b * computed tokens``, least squares; None if unfit."""
    points = [(_computed(r), float(r["prefill_s"])) for r in records if r.get("prefill_s") is not None]
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var <= 0:
        return None
    b = sum((x - mx) * (y - my) for x, y in points) / var
    return my - b * mx, b


def ttft_breakdown(
    records: dict[str, list[dict[str, Any]]],
    summaries: dict[str, dict[str, Any]],
    profile: dict[str, Any],
    name: str = "vllm+hicache",
    limit: str = "vllm-unbounded",
    uncached: tuple[str, ...] = ("vllm", "vllm-unbounded"),
    cpu_s: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The gap between ``name``'s mean TTFT and ``limit``'s, split (ms per request); ``{}`` if either is missing."""
    if name not in summaries or limit not in summaries:
        return {}
    mine, ref = records[name], records[limit]
    gap = (summaries[name]["ttft_s"]["mean"] - summaries[limit]["ttft_s"]["mean"]) * 1e3
    queue = (summaries[name]["queue_s"]["mean"] - summaries[limit]["queue_s"]["mean"]) * 1e3
    extra = sum(map(_computed, mine)) / max(1, len(mine)) - sum(map(_computed, ref)) / max(1, len(ref))
    fit = fit_prefill_cost([r for n in uncached if n in records for r in records[n]])
    recompute = extra * fit[1] * 1e3 if fit is not None else math.nan
    connector = profile.get("critical_path_ms_per_request", 0.0)
    known = queue + connector + (recompute if recompute == recompute else 0.0)
    cpu = {}
    if cpu_s and name in cpu_s and limit in cpu_s:
        # CPU seconds of every process of each configuration, per request: what the background work
        # (storage writes and reads, the cache's loop) adds beside the model, on the same cores.
        cpu = {"cpu_ms_per_request": cpu_s[name] * 1e3 / max(1, len(mine)),
               "limit_cpu_ms_per_request": cpu_s[limit] * 1e3 / max(1, len(ref))}
    return cpu | {
        "ttft_gap_ms": gap,
        "ratio": summaries[name]["ttft_s"]["mean"] / summaries[limit]["ttft_s"]["mean"],
        "queue_ms": queue,
        "connector_ms": connector,
        "extra_computed_tokens_per_request": extra,
        "ms_per_computed_token": fit[1] * 1e3 if fit is not None else math.nan,
        "prefill_fixed_ms": fit[0] * 1e3 if fit is not None else math.nan,
        "recompute_ms": recompute,
        "other_ms": gap - known,
    }


def format_step_profile(profile: dict[str, Any]) -> str:
    if not profile:
        return "  (no connector profile)"
    lines = []
    for hook, v in profile["hooks_per_request"].items():
        if v["calls"]:
            lines.append(f"  {hook:<20} {v['calls']:8.1f} calls  {v['ms']:8.2f} ms")
    lines.append(f"  on vLLM's critical path: {profile['critical_path_ms_per_request']:.2f} ms per request; "
                 f"cache thread CPU {profile['loop_cpu_ms_per_request']:.2f} ms per request")
    lines.append(f"  loads {profile['loads']} ({profile['loaded_tokens']:,} tokens {profile['loaded_by_tier']}); "
                 f"loads cut short {profile['loads_cut_short']} ({profile['tokens_recomputed']:,} tokens recomputed); "
                 f"saved {profile['saved_tokens']:,} tokens, {profile['save_skipped_pages']} pages not saved")
    return "\n".join(lines)


def format_breakdown(b: dict[str, Any], name: str = "vllm+hicache", limit: str = "vllm-unbounded") -> str:
    if not b:
        return f"  ({name} or {limit} did not run)"
    line = (f"  {name} mean TTFT - {limit}'s: {b['ttft_gap_ms']:+,.1f} ms ({b['ratio']:.3f}x) = queue "
            f"{b['queue_ms']:+,.1f} + connector {b['connector_ms']:,.1f} + recompute {b['recompute_ms']:+,.1f} "
            f"({b['extra_computed_tokens_per_request']:+,.0f} tokens a request at {b['ms_per_computed_token']:.3f} ms) "
            f"+ other {b['other_ms']:+,.1f}")
    if "cpu_ms_per_request" in b:
        line += (f"\n  CPU of all its processes per request: {b['cpu_ms_per_request']:,.0f} ms against the limit's "
                 f"{b['limit_cpu_ms_per_request']:,.0f} (the cache's background work runs on the same cores)")
    return line
