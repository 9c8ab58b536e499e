"""The figures of ``hicache bench serve``: its targets, its table, its plot.

Throughput is requests (and input and output tokens) per second from the first request sent to
the last token received; TTFT and ITL are measured at the client; ``queue`` is vLLM's own queue
time (``--enable-per-request-metrics``). The hit rate is the share of prompt tokens the server did
not compute, split into vLLM's own prefix cache and each hicache tier; ``c.ideal`` is what a cache
of unlimited size serving whole blocks could have (``driver.py``), and ``hit/c.ideal`` the share
of it reached.
"""

from __future__ import annotations

import math
from typing import Any

from .breakdown import format_breakdown, format_step_profile
from .report import _grid

__all__ = ["TARGETS", "check_targets", "format_report", "format_table", "plot_serve"]

#: per workload: (key, what, bound); ``what`` names a ratio ``check_targets`` computes
TARGETS: dict[str, list[tuple[str, str]]] = {
    "multiturn": [
        ("ttft_hicache_over_unbounded", "<= 1.2"),
        ("throughput_hicache_over_unbounded", ">= 0.9"),
        ("hicache_hit_vs_computed_ideal", ">= 0.95"),
        ("p99_ttft_hicache_over_vllm", "<= 1.0"),
    ],
    "long-context": [
        ("ttft_hicache_over_unbounded", "<= 1.2"),
        ("ttft_vllm_over_hicache", ">= 4"),
        ("throughput_hicache_over_unbounded", ">= 0.9"),
    ],
}


def _ratios(s: dict[str, dict[str, Any]]) -> dict[str, float]:
    cache, alone, limit = s.get("vllm+hicache"), s.get("vllm"), s.get("vllm-unbounded")
    out: dict[str, float] = {}
    if cache is None:
        return out
    out["hicache_hit_vs_computed_ideal"] = cache["hit_vs_computed_ideal"]
    if limit is not None:
        out["ttft_hicache_over_unbounded"] = cache["ttft_s"]["mean"] / limit["ttft_s"]["mean"]
        out["throughput_hicache_over_unbounded"] = cache["requests_per_s"] / limit["requests_per_s"]
    if alone is not None:
        out["ttft_vllm_over_hicache"] = alone["ttft_s"]["mean"] / cache["ttft_s"]["mean"]
        out["p99_ttft_hicache_over_vllm"] = cache["ttft_s"]["p99"] / alone["ttft_s"]["p99"]
    return out


def check_targets(workload: str, summaries: dict[str, dict[str, Any]], base: str) -> dict[str, Any]:
    """Each target as measured: ``{value, target, met}`` (absent when a configuration did not run)."""
    out: dict[str, Any] = {}
    ratios = _ratios(summaries)
    for key, target in TARGETS.get(workload, []):
        if key not in ratios or ratios[key] != ratios[key]:
            continue
        op, bound = target.split()
        value = ratios[key]
        out[key] = {"value": value, "target": target, "met": value >= float(bound) if op == ">=" else value <= float(bound)}
    cache = summaries.get("vllm+hicache")
    if cache is not None:
        n = cache["loads_cut_short"]
        out["loads_cut_short"] = {"value": n, "target": "== 0", "met": n == 0}
    differ = sum(s.get(f"outputs_differ_from_{base}", 0) for s in summaries.values())
    out["outputs_differing"] = {"value": differ, "target": "== 0", "met": differ == 0}
    return out


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1000:,.0f}"


def _pct(x: float) -> str:
    return "-" if x != x else f"{x * 100:.0f}%"


def format_table(summaries: dict[str, dict[str, Any]], base: str) -> str:
    tiers = sorted({t for s in summaries.values() for t in s["hit_rate_by_tier"]},
                   key=lambda t: ({"vllm": 0, "device": 1, "host": 2}.get(t, 3), t))
    head = ["config", "req/s", "in tok/s", "out tok/s", "TTFT mean", "p50", "p90", "p99", "ITL p50", "p99",
            "queue", "computed/req", "hit", "c.ideal", "hit/c.ideal", *[f"from {t}" for t in tiers], "cut short",
            "differ"]
    rows = [head]
    for name, s in summaries.items():
        t, itl = s["ttft_s"], s["itl_s"]
        rows.append([
            name, f"{s['requests_per_s']:.3f}", f"{s['input_tok_s']:,.0f}", f"{s['output_tok_s']:,.1f}",
            _ms(t["mean"]), _ms(t["p50"]), _ms(t["p90"]), _ms(t["p99"]), _ms(itl["p50"]), _ms(itl["p99"]),
            _ms(s["queue_s"]["mean"]), f"{s['computed_tokens_per_request']:,.0f}", _pct(s["hit_rate"]),
            _pct(s["computed_ideal_hit_rate"]), "-" if s["hit_vs_computed_ideal"] != s["hit_vs_computed_ideal"]
            else f"{s['hit_vs_computed_ideal']:.2f}",
            *[_pct(s["hit_rate_by_tier"].get(tier, 0.0)) for tier in tiers],
            str(s.get("loads_cut_short", 0)), str(s.get(f"outputs_differ_from_{base}", 0)),
        ])
    return _grid(rows)


def format_report(w: dict[str, Any]) -> str:
    configs = list(w["summary"])
    lines = [f"== {w['workload']} (times in ms; TTFT and ITL at the client, queue: vLLM's) ==",
             format_table(w["summary"], configs[0]), ""]
    if w.get("connector_profile"):
        lines += ["the connector's step, per request (ms on vLLM's critical path):",
                  format_step_profile(w["connector_profile"])]
    if w.get("ttft_breakdown"):
        lines.append(format_breakdown(w["ttft_breakdown"]))
    lines.append("")
    for key, t in w["targets"].items():
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"  {key}: {shown} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def plot_serve(workloads: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """One row per workload: the TTFT distribution of each configuration, and its throughput and hit rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(workloads)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.2 * rows), squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (name, w), (left, right) in zip(workloads.items(), axes):
        summaries = w["summary"]
        color = {c: palette[i % len(palette)] for i, c in enumerate(summaries)}
        for c, r in w["configurations"].items():
            xs = sorted(rec["ttft_s"] * 1000 for rec in r["records"])
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            left.step(xs, ys, where="post", color=color[c], label=f"{c} (mean {summaries[c]['ttft_s']['mean'] * 1e3:,.0f} ms)")
        left.set_xscale("log")
        left.set_xlabel("time to first token at the client (ms, log scale)")
        left.set_ylabel("share of requests")
        left.set_title(f"{name}: TTFT")
        left.grid(True, which="both", alpha=0.3)
        left.legend(fontsize=8)
        names = list(summaries)
        x = range(len(names))
        tput = [summaries[c]["requests_per_s"] for c in names]
        right.bar(x, tput, color=[color[c] for c in names])
        right.set_xticks(list(x), names)
        right.set_ylabel("requests / s")
        right.set_title(f"{name}: throughput (hit rate above each bar)")
        for i, c in enumerate(names):
            hit = summaries[c]["hit_rate"]
            right.annotate("-" if hit != hit or math.isnan(hit) else f"{hit:.0%}", (i, tput[i]), ha="center",
                           va="bottom", fontsize=9)
        right.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
