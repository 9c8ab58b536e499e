"""``hicache bench vllm-overhead``: what the connector costs vLLM when it cannot help.

Every prompt is new (random tokens, one turn each), so neither vLLM's prefix cache nor hicache ever
hits: vLLM + hicache does all of vLLM's work plus the connector's (two lookups per request over the
side channel, the per-step hooks, every full page saved, backed up to the host tier and written to
the file tier), and gets nothing back. Against vLLM alone, same trace, same KV memory and, in
multi-process mode, the same ``VLLM_CPU_NUM_OF_RESERVED_CPU`` on both sides (vLLM otherwise
reserves a core more for a server with a connector). Targets: p50 TTFT <= 1.03x and throughput
>= 0.97x of vLLM alone's.

Configurations run in fresh processes, interleaved (``vllm``, ``vllm+hicache``, then the other order,
``--repeats`` pairs) so that a machine that gets busier or quieter affects both alike. The closing
breakdown comes from the connector's own profile (``hicache.integrations.vllm.profile``): seconds
per request in the scheduler's lookups and plans and in the worker's hooks (all on vLLM's critical
path), CPU seconds of the cache's thread (channel, commits), and the CPU seconds of every process
of each configuration (vLLM's and hicache's background copies and writes included).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .models import smollm2_dir
from .report import percentile
from .scratch import add_keep_pages_argument, pages_removed
from .vllm_bench import _geometry, add_vllm_process_arguments, default_config_path, run_worker

__all__ = ["add_parser", "run_overhead_benchmark"]

CONFIGURATIONS = ("vllm", "vllm+hicache")
TARGETS = {"ttft_p50_ratio": 1.03, "throughput_ratio": 0.97}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vllm-overhead", help="what the vLLM connector costs when nothing hits (needs vLLM)")
    g = p.add_argument_group("workload")
    g.add_argument("--requests", type=int, default=16, help="requests, each a new random prompt")
    g.add_argument("--prompt-length", type=int, default=1024)
    g.add_argument("--output-length", type=int, default=16)
    g = p.add_argument_group("run")
    g.add_argument("--repeats", type=int, default=2, help="interleaved pairs of runs (ABBA order)")
    g.add_argument("--max-parallel", type=int, default=1,
                   help="requests in flight from the clients (above 1, see \"prefills sharing a step\")")
    g.add_argument("--max-running", type=int, default=4, help="vLLM's max_num_seqs (its KV memory holds them)")
    g.add_argument("--host-fraction", type=float, default=0.5, help="hicache's host tier / the trace's KV")
    g.add_argument("--config", default=None, help="hicache YAML for the connector (default: config/vllm.yaml)")
    g.add_argument("--block-size", type=int, default=128)
    add_vllm_process_arguments(g)
    g.set_defaults(vllm_mode="multi")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default=None, help="folder for results.json and the file tier")
    add_keep_pages_argument(g)
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def _sizes(args: argparse.Namespace, geo: dict[str, int]) -> dict[str, int]:
    bs = args.block_size
    max_model_len = math.ceil((args.prompt_length + args.output_length) / bs) * bs
    blocks = args.max_running * max_model_len // bs  # the running batch fits: nothing queues for KV
    page_bytes = bs * geo["token_bytes"]
    trace_pages = args.requests * math.ceil((args.prompt_length + args.output_length) / bs)
    host_pages = max(math.ceil(trace_pages * args.host_fraction), max_model_len // bs + 1)
    return {
        "max_model_len": max_model_len,
        "kv_cache_bytes": (blocks + 1) * page_bytes,  # vLLM keeps block 0 as its null block
        "vllm_kv_tokens": blocks * bs,
        "host_bytes": host_pages * page_bytes,
        "file_bytes": (trace_pages + 1) * page_bytes,
        "trace_tokens": trace_pages * bs,
    }


def _spec(args: argparse.Namespace, name: str, sizes: dict[str, int], pages: Path) -> dict[str, Any]:
    connector = None
    if name == "vllm+hicache":
        shutil.rmtree(pages, ignore_errors=True)  # never a hit from an earlier run
        connector = {
            "config": args.config or default_config_path(),
            "overrides": {"tiers": {
                "host": {"capacity": sizes["host_bytes"], "pin_memory": False},
                "storage": [{"kind": "file", "path": str(pages), "capacity": sizes["file_bytes"], "fsync": "never"}],
            }},
        }
    return {
        "configuration": name,
        "model_dir": str(smollm2_dir()),
        "workload": {"clients": args.requests, "rounds": 1, "request_len": args.prompt_length,
                     "output_len": args.output_length, "seed": args.seed},
        "connector": connector,
        "vllm_mode": args.vllm_mode,
        "reserved_cpus": args.reserved_cpus,
        "block_size": args.block_size,
        "max_model_len": sizes["max_model_len"],
        "kv_cache_bytes": sizes["kv_cache_bytes"],
        "max_running": args.max_running,
        "max_parallel": args.max_parallel,
        "ready_queue": "fifo",
        "seed": args.seed,
        "progress": not args.quiet,
    }


def _run_figures(result: dict[str, Any]) -> dict[str, Any]:
    records = result["records"]
    start = min(r["arrival_s"] for r in records)
    duration = max(r["finished_s"] for r in records) - start
    ttft = [r["ttft_s"] for r in records]
    return {
        "requests": len(records),
        "duration_s": duration,
        "requests_per_s": len(records) / duration,
        "output_tok_s": sum(len(r["output"]) for r in records) / duration,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "cpu_s": result.get("cpu_s", {}),
    }


def _timings(result: dict[str, Any]) -> list[dict[str, float]]:
    """Each request's times (seconds from the run's first arrival), to see how a p50 moved."""
    records = result["records"]
    start = min(r["arrival_s"] for r in records)
    return [{"arrival_s": r["arrival_s"] - start, "ttft_s": r["ttft_s"], "queue_s": r["queue_s"],
             "prefill_s": r["prefill_s"], "finished_s": r["finished_s"] - start} for r in records]


def _shared_prefills(records: list[dict[str, Any]], within_s: float = 0.05) -> int:
    """Requests whose first token came with another's (their prefills ran in one step).

    With requests in flight that start together, whether vLLM schedules their prefills in one step
    or one after the other is a race decided by microseconds (which request its scheduler sees
    before it plans a step), and it moves the p50 TTFT by a whole prefill while the throughput
    stays: counted, so a ratio that comes from it is seen as such.
    """
    firsts = sorted(r["arrival_s"] + r["ttft_s"] for r in records)
    return sum(1 for i, t in enumerate(firsts)
               if (i > 0 and t - firsts[i - 1] < within_s) or (i + 1 < len(firsts) and firsts[i + 1] - t < within_s))


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    records = [r for run in runs for r in run["records"]]
    duration = sum(_run_figures(run)["duration_s"] for run in runs)
    ttft = [r["ttft_s"] for r in records]
    cpu: dict[str, float] = {}
    for run in runs:
        for k, v in run.get("cpu_s", {}).items():
            cpu[k] = cpu.get(k, 0.0) + v
    return {
        "requests": len(records),
        "duration_s": duration,
        "requests_per_s": len(records) / duration,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_mean_s": sum(ttft) / len(ttft),
        "shared_prefills": sum(_shared_prefills(run["records"]) for run in runs) / len(records),
        "cached_tokens": sum(r["cached_tokens"] for r in records),
        "cpu_s_per_request": {k: v / len(records) for k, v in cpu.items()},
    }


def _breakdown(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The connector's profile summed over the vllm+hicache runs, per request."""
    n = sum(len(run["records"]) for run in runs)
    hooks: dict[str, list[float]] = {}
    loop_cpu = 0.0
    saved = loads = lookups = 0
    for run in runs:
        stats = run.get("cache_stats") or {}
        for side, profile in (stats.get("profile") or {}).items():
            for hook, (calls, seconds) in profile.items():
                entry = hooks.setdefault(f"{side}.{hook}", [0.0, 0.0])
                entry[0] += calls
                entry[1] += seconds
        loop_cpu += stats.get("loop_cpu_s") or 0.0
        c = stats.get("connector") or {}
        saved += c.get("saved_tokens", 0)
        loads += c.get("loads", 0)
        lookups += c.get("lookups", 0)
    per_request = {k: {"calls": calls / n, "ms": seconds / n * 1e3} for k, (calls, seconds) in sorted(hooks.items())}
    critical = sum(v["ms"] for v in per_request.values())
    return {"requests": n, "hooks_per_request": per_request, "critical_path_ms_per_request": critical,
            "loop_cpu_ms_per_request": loop_cpu / n * 1e3, "saved_tokens": saved, "loads": loads, "lookups": lookups}


def run_overhead_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hicache bench vllm-overhead needs vLLM: run it from .venv-vllm")
    out = Path(args.out or "bench-results/vllm-overhead").resolve()
    out.mkdir(parents=True, exist_ok=True)
    sizes = _sizes(args, _geometry(smollm2_dir()))
    cores = (f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} on both sides" if args.vllm_mode == "multi"
             else f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', min(os.cpu_count() or 1, 2))} on both sides")
    print(f"hicache bench vllm-overhead: SmolLM2-135M fp32, vLLM {args.vllm_mode}-process ({cores}); "
          f"{args.requests} new prompts of {args.prompt_length} tokens, {args.output_length} out, "
          f"{args.max_parallel} in flight, {args.repeats} interleaved pairs", file=sys.stderr)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGURATIONS}
    order: list[str] = []
    with pages_removed([out / "pages"], args.keep_pages):
        for r in range(args.repeats):
            for name in (CONFIGURATIONS if r % 2 == 0 else CONFIGURATIONS[::-1]):
                order.append(name)
                runs[name].append(run_worker(_spec(args, name, sizes, out / "pages")))
    pooled = {name: _pooled(rs) for name, rs in runs.items()}
    alone, cached = pooled["vllm"], pooled["vllm+hicache"]
    ratios = {
        "ttft_p50_ratio": cached["ttft_p50_s"] / alone["ttft_p50_s"],
        "throughput_ratio": cached["requests_per_s"] / alone["requests_per_s"],
    }
    pairs = []
    for a, b in zip(runs["vllm"], runs["vllm+hicache"]):
        fa, fb = _run_figures(a), _run_figures(b)
        pairs.append({"ttft_p50_ratio": fb["ttft_p50_s"] / fa["ttft_p50_s"],
                      "throughput_ratio": fb["requests_per_s"] / fa["requests_per_s"]})
    targets = {
        "ttft_p50_ratio": {"value": ratios["ttft_p50_ratio"], "target": f"<= {TARGETS['ttft_p50_ratio']}",
                           "met": ratios["ttft_p50_ratio"] <= TARGETS["ttft_p50_ratio"]},
        "throughput_ratio": {"value": ratios["throughput_ratio"], "target": f">= {TARGETS['throughput_ratio']}",
                             "met": ratios["throughput_ratio"] >= TARGETS["throughput_ratio"]},
        "never_hits": {"value": alone["cached_tokens"] + cached["cached_tokens"], "target": "== 0",
                       "met": alone["cached_tokens"] + cached["cached_tokens"] == 0},
    }
    breakdown = _breakdown(runs["vllm+hicache"])
    report = {
        "benchmark": "vllm-overhead",
        "workload": {"requests": args.requests, "prompt_len": args.prompt_length, "output_len": args.output_length,
                     "max_parallel": args.max_parallel, "seed": args.seed},
        "vllm": {"mode": args.vllm_mode, "reserved_cpus": args.reserved_cpus if args.vllm_mode == "multi" else None,
                 "block_size": args.block_size, "max_num_seqs": args.max_running},
        "sizes": sizes,
        "order": order,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu_pressure": _cpu_pressure()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "pooled": pooled,
        "pairs": pairs,
        "ratios": ratios,
        "targets": targets,
        "breakdown": breakdown,
        "runs": {name: [{k: v for k, v in r.items() if k != "records"} | {"figures": _run_figures(r),
                                                                          "requests": _timings(r)} for r in rs]
                 for name, rs in runs.items()},
    }
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print(_format(report))
    print(f"\nwrote {out / 'results.json'}")
    return report


def _format(report: dict[str, Any]) -> str:
    pooled, b = report["pooled"], report["breakdown"]
    lines = ["| configuration | requests | p50 TTFT ms | p90 TTFT ms | mean TTFT ms | prefills sharing a step "
             "| requests/s | CPU s / request |", "|---|---|---|---|---|---|---|---|"]
    for name, p in pooled.items():
        lines.append(f"| {name} | {p['requests']} | {p['ttft_p50_s'] * 1e3:,.0f} | {p['ttft_p90_s'] * 1e3:,.0f} | "
                     f"{p['ttft_mean_s'] * 1e3:,.0f} | {p['shared_prefills']:.0%} | "
                     f"{p['requests_per_s']:.3f} | {p['cpu_s_per_request'].get('total', math.nan):.2f} |")
    lines.append("")
    for key, t in report["targets"].items():
        lines.append(f"  {key}: {t['value']:.3f} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    pairs = ", ".join(f"{p['ttft_p50_ratio']:.3f}/{p['throughput_ratio']:.3f}" for p in report["pairs"])
    lines.append(f"  per pair (p50 TTFT ratio / throughput ratio): {pairs}")
    lines.append("")
    lines.append(f"connector cost per request ({b['requests']} requests; {b['lookups']} lookups, "
                 f"{b['saved_tokens']:,} tokens saved, {b['loads']} loads):")
    for hook, v in b["hooks_per_request"].items():
        lines.append(f"  {hook:<18} {v['calls']:7.1f} calls  {v['ms']:8.2f} ms")
    alone = pooled["vllm"]["cpu_s_per_request"]
    cached = pooled["vllm+hicache"]["cpu_s_per_request"]
    lines.append(f"  on vLLM's critical path: {b['critical_path_ms_per_request']:.2f} ms; cache thread CPU "
                 f"{b['loop_cpu_ms_per_request']:.2f} ms; CPU of all processes "
                 f"{cached.get('total', math.nan) * 1e3:,.0f} vs {alone.get('total', math.nan) * 1e3:,.0f} ms "
                 f"(worker {cached.get('worker', math.nan) * 1e3:,.0f} vs {alone.get('worker', math.nan) * 1e3:,.0f}, "
                 f"engine core {cached.get('engine_core', math.nan) * 1e3:,.0f} vs "
                 f"{alone.get('engine_core', math.nan) * 1e3:,.0f})")
    pressure = report["machine"]["cpu_pressure"]
    if pressure:
        lines.append(f"  CPU pressure at the end: {pressure}")
    return "\n".join(lines)


def _cpu_pressure() -> str | None:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return None
