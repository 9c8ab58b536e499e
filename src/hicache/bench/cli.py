"""``hicache bench multiturn|long-context|vllm|vllm-overhead|serve|pd|recurrent``: run the configurations on one trace, compare them.

Each configuration runs in its own process (``hicache.bench.worker``), in the order given (with
``--repeat N``, N times in alternating order: ``repeats.py``); the parent prints the table,
writes ``results.json`` and ``plot.png`` into ``--out``.
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .models import MODELS
from .pd_bench import add_parser as add_pd_parser
from .pd_bench import run_pd_benchmark
from .profiling import cpu_pressure
from .recurrent_bench import add_parser as add_recurrent_parser
from .recurrent_bench import run_recurrent_benchmark
from .repeats import format_repeats, per_repeat, pool, run_order, spread, summarise_runs
from .report import (
    add_oracle_ratios,
    check_targets,
    format_activity,
    format_rounds,
    format_stages,
    format_table,
    outputs_of,
    plot,
    storage_bytes_vs_whole_pages,
)
from .scenarios import CONFIGURATIONS, DEFAULT_CONFIGURATIONS, Sizing, lossy_pages_dir
from .scratch import add_keep_pages_argument, pages_removed
from .route_bench import add_parser as add_route_parser
from .route_bench import run_route_benchmark
from .serve_bench import add_parser as add_serve_parser
from .serve_bench import run_serve_benchmark
from .vllm_bench import add_parser as add_vllm_parser
from .vllm_bench import run_vllm_benchmark
from .vllm_overhead import add_parser as add_vllm_overhead_parser
from .vllm_overhead import run_overhead_benchmark
from .worker import RunSpec
from .workloads import LongContext, MultiTurn

__all__ = ["base_spec", "main", "run_benchmark"]


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--model", choices=sorted(MODELS), default="smollm2", help="model preset (default: smollm2)")
    g.add_argument("--configs", default=",".join(DEFAULT_CONFIGURATIONS),
                   help=f"comma-separated, in run order, from {', '.join(CONFIGURATIONS)} (default: %(default)s)")
    g.add_argument("--config", default=None, help="base hicache YAML (default: the packaged config/bench.yaml)")
    g.add_argument("--out", default=None, help="folder for results.json, plot.png and the file tier")
    add_keep_pages_argument(g)
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    g.add_argument("--max-parallel", type=int, default=2, help="requests in flight from the clients")
    g.add_argument("--sequential", action="store_true",
                   help="one request at a time (--max-parallel 1 --max-running 1): TTFT without queueing")
    g.add_argument("--max-running", type=int, default=4, help="requests the engine runs at once (token-interleaved)")
    g.add_argument("--ready-queue-policy", choices=["fifo", "random"], default="random")
    g.add_argument("--round-barrier", action="store_true", help="start round k+1 when every client ended round k")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device-fraction", type=float, default=0.25, help="device tier / workload KV")
    g.add_argument("--host-fraction", type=float, default=0.5, help="host tier / workload KV")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--no-yield", action="store_true",
                   help="the cache's backups and storage writes do not wait for prefills (for comparison)")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler in each configuration: its top operators go into results.json")
    g.add_argument("--metrics", action="store_true",
                   help="write each configuration's Prometheus metrics (the cache's and the engine's, as "
                        "scraped at the end of its run) to metrics-<configuration>.prom in --out "
                        "(needs the metrics extra)")
    g.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run the configurations N times, in alternating order (as given, reversed, ...), and "
                        "pool each one's requests, so the machine's drift weighs on all alike (default: 1)")
    g.add_argument("--interleave", action="store_true",
                   help="with --sequential: the configurations in one process, taking turns request by request "
                        "(alternating order), each request followed by its cache's background work; ratios then "
                        "compare requests seconds apart (not warm-restart, --profile or --metrics)")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    mt = sub.add_parser("multiturn", help="clients in multi-turn chats (SGLang bench_multiturn's shape)")
    g = mt.add_argument_group("workload")
    g.add_argument("--num-clients", type=int, default=MultiTurn.clients)
    g.add_argument("--num-rounds", type=int, default=MultiTurn.rounds)
    g.add_argument("--request-length", type=int, default=MultiTurn.request_len, help="new tokens per turn")
    g.add_argument("--output-length", type=int, default=MultiTurn.output_len)
    _common(mt)
    lc = sub.add_parser("long-context", help="many questions on a few long shared documents")
    g = lc.add_argument_group("workload")
    g.add_argument("--num-documents", type=int, default=LongContext.documents)
    g.add_argument("--document-length", type=int, default=LongContext.document_len)
    g.add_argument("--questions-per-document", type=int, default=LongContext.questions)
    g.add_argument("--question-length", type=int, default=LongContext.question_len)
    g.add_argument("--output-length", type=int, default=LongContext.output_len)
    _common(lc)
    add_vllm_parser(sub)  # `hicache bench vllm`: the same multi-turn trace through vLLM (vllm_bench.py)
    add_vllm_overhead_parser(sub)  # `hicache bench vllm-overhead`: the connector's cost when nothing hits
    add_serve_parser(sub)  # `hicache bench serve`: vllm serve over HTTP, multi-turn and long-context (serve_bench.py)
    add_route_parser(sub)  # `hicache bench route`: two vllm serve workers behind a KV-aware router (route_bench.py)
    add_pd_parser(sub)  # `hicache bench pd`: prefill/decode over vllm serve, hicache against vLLM's connectors (pd_bench.py)
    add_recurrent_parser(sub)  # `hicache bench recurrent`: a recurrent hybrid's checkpoints (recurrent_bench.py)
    return parser


def _workload(args: argparse.Namespace) -> dict[str, Any]:
    if args.benchmark == "multiturn":
        return dict(clients=args.num_clients, rounds=args.num_rounds, request_len=args.request_length,
                    output_len=args.output_length, seed=args.seed)
    return dict(documents=args.num_documents, document_len=args.document_length,
                questions=args.questions_per_document, question_len=args.question_length,
                output_len=args.output_length, seed=args.seed)


def default_config_path() -> str:
    """``config/bench.yaml`` of a source checkout, else the copy shipped in the package."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[3] / "config" / "bench.yaml", here.parent / "bench.yaml"):
        if candidate.exists():
            return str(candidate)
    raise FileNotFoundError("config/bench.yaml not found: pass --config")


def base_spec(args: argparse.Namespace, out: Path) -> RunSpec:
    """The settings every configuration of this run shares (``configuration`` left empty)."""
    max_parallel, max_running = (1, 1) if args.sequential else (args.max_parallel, args.max_running)
    return RunSpec(
        benchmark=args.benchmark,
        workload=_workload(args),
        configuration="",
        out_dir=str(out),
        model=args.model,
        seed=args.seed,
        driver=dict(request_rate=args.request_rate, max_parallel=max_parallel,
                    ready_queue=args.ready_queue_policy, round_barrier=args.round_barrier, seed=args.seed),
        sizing=dict(device_fraction=args.device_fraction, host_fraction=args.host_fraction),
        config_path=args.config or default_config_path(),
        max_running=max_running,
        progress=not args.quiet,
        profile=args.profile,
        yield_to_prefills=not args.no_yield,
        metrics=args.metrics,
    )


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}")
    if "warm-restart" in configs and ("hierarchical" not in configs or configs.index("hierarchical") > configs.index("warm-restart")):
        raise SystemExit("warm-restart reuses the file tier that hierarchical leaves: run hierarchical before it")
    if args.repeat < 1:
        raise SystemExit("--repeat must be at least 1")
    if args.interleave:
        if not args.sequential:
            raise SystemExit("--interleave needs --sequential (configurations take turns one request at a time)")
        if "warm-restart" in configs or args.profile or args.metrics:
            raise SystemExit("--interleave runs without warm-restart (it needs a fresh process), --profile and --metrics")
    if args.metrics and any(importlib.util.find_spec(m) is None for m in ("prometheus_client", "h11")):
        raise SystemExit("--metrics needs prometheus-client and h11: pip install 'hicache[metrics]'")
    out = Path(args.out or f"bench-results/{args.benchmark}-{args.model}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    base = base_spec(args, out)
    workload = base.make_workload()
    print(f"hicache bench {args.benchmark}: model {args.model} ({MODELS[args.model].description})", file=sys.stderr)
    print(f"  workload {workload}; {workload.requests} requests, {workload.kv_tokens():,} tokens of KV", file=sys.stderr)
    # With `lossy` and `no-cache` both in the run: their first-token logits, to compare (lossy_figures).
    lossy_pair = {"lossy", "no-cache"} if {"lossy", "no-cache"} <= set(configs) and not args.interleave else set()
    orders = run_order(configs, args.repeat)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    with pages_removed([Path(base.pages_dir), Path(lossy_pages_dir(base.pages_dir))], args.keep_pages):
        for k, order in enumerate(orders):
            if args.repeat > 1:
                print(f"  repeat {k + 1} of {args.repeat}: {' '.join(order)}", file=sys.stderr)
            if args.interleave:
                together = _run_worker(RunSpec(**{**asdict(base), "configuration": "interleaved", "interleave": order}))
                for name in order:
                    runs[name].append(together[name])
                continue
            for name in order:
                spec = RunSpec(**{**asdict(base), "configuration": name, "first_logits": name in lossy_pair})
                runs[name].append(_run_worker(spec))
    results = {name: pool(rs) for name, rs in runs.items()}
    summaries = {name: summarise_runs(rs) for name, rs in runs.items()}
    add_oracle_ratios(summaries)
    for name, r in results.items():
        summaries[name]["cpu_pressure"] = {"before": r["machine"]["cpu_pressure_before"],
                                           "after": r["machine"]["cpu_pressure_after"]}
        summaries[name]["storage_bytes_vs_whole_pages"] = storage_bytes_vs_whole_pages(
            r.get("cache_stats"), r.get("cache_config"))
    reference = outputs_of(runs[configs[0]][0]["records"])
    for name, rs in runs.items():
        summaries[name]["outputs_differ_from_" + configs[0]] = sum(
            1 for r in rs for k, v in outputs_of(r["records"]).items() if reference.get(k) != v)
    if lossy_pair:
        summaries["lossy"].update(lossy_figures(runs, out))
    repeats = per_repeat(runs, orders) if args.repeat > 1 else []
    tiers = sorted({t for s in summaries.values() for t in s["hit_rate_by_tier"]}, key=_tier_order)
    report = {
        "benchmark": args.benchmark,
        "model": {"preset": args.model, "description": MODELS[args.model].description},
        "workload": base.workload,
        "driver": base.driver,
        "max_running": base.max_running,
        "sizing": asdict(Sizing(**base.sizing)),
        "kv_tokens": workload.kv_tokens(),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu_pressure_at_end": cpu_pressure()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "summary": summaries,
        "targets": check_targets(summaries),
        "repeats": repeats,
        "configurations": results,
    }
    (out / "results.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    print(format_table(summaries, tiers))
    print()
    if repeats:
        print(f"each repeat (mean TTFT, ms; the table above pools all {args.repeat}):")
        print(format_repeats(repeats))
        print()
    pressure = ", ".join(
        f"{n} {_avg60(s['cpu_pressure']['before'])}-{_avg60(s['cpu_pressure']['after'])}" for n, s in summaries.items()
    )
    print(f"CPU pressure (/proc/pressure/cpu some avg60, %, at start-end of each): {pressure}")
    print()
    stored = {n: s["storage_bytes_vs_whole_pages"] for n, s in summaries.items()
              if s["storage_bytes_vs_whole_pages"] == s["storage_bytes_vs_whole_pages"]}
    if stored:
        print("bytes written to storage per page stored, over a whole page's (every layer): "
              + ", ".join(f"{n} {v:.3f}" for n, v in stored.items()))
        print()
    drains = {n: s["drain_s"] for n, s in summaries.items() if s.get("drain_s")}
    if drains:
        print("background work after each request (interleaved turns wait for it; mean / max ms): "
              + ", ".join(f"{n} {d['mean'] * 1e3:,.1f} / {d['max'] * 1e3:,.1f}" for n, d in drains.items()))
        print()
    print("where the time goes (mean ms per request; `other`: TTFT no stage timer covers):")
    print(format_stages(summaries))
    print()
    if args.profile:
        print("traced work (--profile):")
        print(format_activity(results))
        print()
    print("hit rate per round:")
    print(format_rounds(summaries))
    if lossy_pair:
        lossy = summaries["lossy"]
        print(f"lossy (int8 KV on the file tier) against no-cache: greedy outputs identical on "
              f"{lossy['greedy_agreement_with_no_cache']:.1%} of {lossy['requests']} requests (target >= 95%); "
              f"first-token logits |lossy - no-cache| mean {lossy['first_token_logit_mean_abs_diff']:.4f}, "
              f"max {lossy['first_token_logit_max_abs_diff']:.4f} over {lossy['first_token_logit_requests']} "
              f"requests with the same prompt")
    for name, s in summaries.items():
        differ = s["outputs_differ_from_" + configs[0]]
        if differ:
            print(f"note: {differ} of {s['requests']} outputs of {name} differ from {configs[0]}'s")
    if report["targets"]:
        print()
        for key, t in report["targets"].items():
            each = ""
            if repeats:
                values, met = spread(repeats, key)
                each = f"; each repeat: {', '.join(f'{v:.2f}' for v in values)} (met in {met} of {len(values)})"
            print(f"  {key}: {t['value']:.2f} (target {t['target']}): {'met' if t['met'] else 'MISSED'}{each}")
    if args.metrics:
        print()
        for name in configs:
            print(f"wrote {out / f'metrics-{name}.prom'}")
    if not args.no_plot:
        title = f"hicache bench {args.benchmark}: {args.model}, {workload.requests} requests"
        plot(summaries, {n: r["records"] for n, r in results.items()}, str(out / "plot.png"), title)
        print(f"\nwrote {out / 'results.json'} and {out / 'plot.png'}")
    else:
        print(f"\nwrote {out / 'results.json'}")
    return report


def lossy_figures(runs: dict[str, list[dict[str, Any]]], out: Path) -> dict[str, Any]:
    """Greedy-output agreement of ``lossy`` with ``no-cache`` over the trace (every repeat), and the
    mean and max absolute first-token logit difference over the requests whose prompts match."""
    import torch

    reference = [outputs_of(r["records"]) for r in runs["no-cache"]]
    same = total = 0
    for i, run in enumerate(runs["lossy"]):
        ref = reference[min(i, len(reference) - 1)]
        for key, output in outputs_of(run["records"]).items():
            total += 1
            same += ref.get(key) == output
    exact = torch.load(out / "first-logits-no-cache.pt")
    lossy = torch.load(out / "first-logits-lossy.pt")
    diffs = [(lossy[k] - exact[k]).abs() for k in lossy.keys() & exact.keys()]
    return {
        "greedy_agreement_with_no_cache": same / total if total else float("nan"),
        "first_token_logit_mean_abs_diff": float(torch.stack([d.mean() for d in diffs]).mean()) if diffs else float("nan"),
        "first_token_logit_max_abs_diff": float(max(d.max() for d in diffs)) if diffs else float("nan"),
        "first_token_logit_requests": len(diffs),
    }


def _avg60(p: dict[str, float] | None) -> str:
    return "?" if not p else f"{p.get('avg60', float('nan')):.0f}"


def _tier_order(name: str) -> tuple[int, str]:
    return ({"device": 0, "host": 1}.get(name, 2), name)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _run_worker(spec: RunSpec) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    try:
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        proc = subprocess.run(
            [sys.executable, "-m", "hicache.bench.worker", out_path],
            input=json.dumps(asdict(spec)),
            text=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"configuration {spec.configuration} failed (exit status {proc.returncode})")
        return json.loads(Path(out_path).read_text())
    finally:
        os.unlink(out_path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.benchmark == "vllm":
        run_vllm_benchmark(args)
    elif args.benchmark == "vllm-overhead":
        run_overhead_benchmark(args)
    elif args.benchmark == "serve":
        run_serve_benchmark(args)
    elif args.benchmark == "pd":
        run_pd_benchmark(args)
    elif args.benchmark == "route":
        run_route_benchmark(args)
    elif args.benchmark == "recurrent":
        run_recurrent_benchmark(args)
    else:
        run_benchmark(args)
    return 0

