"""``hicache bench route``: two ``vllm serve`` workers with hicache behind a KV-aware router.

Per configuration, two fresh workers (SmolLM2-135M, fp32, on loopback), each with the hicache
connector (a host tier of ``--host-fraction`` of the workload's history and a file tier of its own of
``--file-fraction``: together the workers hold the history only if each conversation stays on one),
vLLM's KV holding about ``--kv-fraction`` of it, and vLLM's ``--kv-events-config`` publishing on loopback. The multi-turn
workload's clients send every request to the router, which picks a worker:

* ``round-robin``: in turn, whatever the prompt;
* ``kv-vllm-events``: the worker whose blocks cover most of the prompt in NVIDIA Dynamo's KV
  indexer (``python -m dynamo.indexer``, from ``.venv-dynamo``: the index Dynamo's KV router
  scores with), fed vLLM's own events only (its GPU blocks: ``kv_connector_extra_config.kv_events:
  false``);
* ``kv-hicache-events``: the same router and indexer fed vLLM's events and hicache's (its host and
  file tiers, ``docs/routing.md``).

The router's policy is ours, shaped as Dynamo's KV router's cost: for each worker, the blocks it
would compute (the prompt's blocks less its overlap in Dynamo's ``/query``) plus the blocks of the
requests in flight on it; the lowest cost wins, ties in turn. Dynamo's full KV router (its frontend) needs its workers to
run as ``python -m dynamo.vllm``, which does not import on this machine's vLLM (``docs/routing.md``).

Per request the router's predicted hit (the chosen worker's overlap in tokens, short of the prompt's
last token) is kept beside the hit vLLM served (``prompt_tokens_details.cached_tokens``). Printed per
configuration: mean and median TTFT, hit tokens, the prediction error (sum of |predicted - served| /
sum of served); and the targets: round robin / kv-hicache-events mean TTFT >= 1.5,
kv-vllm-events / kv-hicache-events > 1, prediction error <= 2%.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import anyio

from .driver import DriverSettings, drive
from .models import smollm2_dir
from .openai_client import CompletionsClient
from .serve_bench import longest_context
from .vllm_bench import _geometry, default_config_path
from .vllm_server import VllmServer, free_port, hicache_transfer
from .workloads import MultiTurn

__all__ = ["CONFIGURATIONS", "add_parser", "run_route_benchmark"]

CONFIGURATIONS = ("round-robin", "kv-vllm-events", "kv-hicache-events")
WORKLOAD = MultiTurn(clients=8, rounds=5, request_len=256, output_len=16)
_REPO = Path(__file__).resolve().parents[3]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("route", help="two vllm serve workers with hicache behind a KV-aware router (Dynamo's "
                                     "indexer): hicache's events vs vLLM's own vs round robin (needs vLLM)")
    g = p.add_argument_group("multiturn")
    g.add_argument("--num-clients", type=int, default=WORKLOAD.clients)
    g.add_argument("--num-rounds", type=int, default=WORKLOAD.rounds)
    g.add_argument("--request-length", type=int, default=WORKLOAD.request_len, help="new tokens per turn")
    g.add_argument("--output-length", type=int, default=WORKLOAD.output_len)
    g.add_argument("--max-parallel", type=int, default=2, help="requests in flight from the clients")
    g = p.add_argument_group("run")
    g.add_argument("--configs", default=",".join(CONFIGURATIONS), help="comma-separated, in run order")
    g.add_argument("--runs", type=int, default=1, help="repeat every configuration (fresh workers each time)")
    g.add_argument("--kv-fraction", type=float, default=0.25, help="each worker's vLLM KV / the workload's history")
    g.add_argument("--host-fraction", type=float, default=0.25, help="each worker's host tier / the history")
    g.add_argument("--file-fraction", type=float, default=0.5,
                   help="each worker's file tier / the history (below 1: the two workers' tiers hold the history "
                        "only if each conversation stays on one worker)")
    g.add_argument("--block-size", type=int, default=128, help="vLLM's block size (and hicache's page)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default=None, help="folder for results.json, the servers' logs and file tiers")
    g.add_argument("--start-timeout", type=float, default=600.0)
    g.add_argument("--dynamo-python", default=None,
                   help="the Python with ai-dynamo (default: .venv-dynamo/bin/python; `make venv-dynamo`)")


def _sizes(args: argparse.Namespace, workload: MultiTurn, token_bytes: int) -> dict[str, int]:
    bs = args.block_size
    history = workload.kv_tokens()
    max_model_len = math.ceil(longest_context(workload) / bs) * bs
    running = args.max_parallel
    # vLLM's KV: the fraction of the history, at least what the running requests need at the longest context
    blocks = max(math.ceil(history * args.kv_fraction / bs), running * max_model_len // bs + 1)
    host_pages = max(math.ceil(history * args.host_fraction / bs), running * max_model_len // bs + 1)
    return {
        "history_tokens": history, "max_model_len": max_model_len, "vllm_blocks": blocks,
        "kv_cache_bytes": blocks * bs * token_bytes, "host_bytes": host_pages * bs * token_bytes,
        "file_bytes": max(math.ceil(history * args.file_fraction / bs), host_pages + 1) * bs * token_bytes,
    }


def _worker(args: argparse.Namespace, config: str, i: int, sizes: dict[str, int], out: Path,
            ports: tuple[int, int]) -> VllmServer:
    bs = args.block_size
    pages = out / f"pages-{config}-{i}"
    shutil.rmtree(pages, ignore_errors=True)
    engine_id = f"hicache-bench-route-{os.getpid()}-{config}-{i}"
    transfer = hicache_transfer(engine_id, {
        "config": default_config_path(),
        "kv_events": config != "kv-vllm-events",
        "overrides": {
            "tiers": {"host": {"capacity": sizes["host_bytes"], "pin_memory": False},
                      "storage": [{"kind": "file", "name": "disk", "path": str(pages),
                                   "capacity": sizes["file_bytes"], "fsync": "never"}]},
            "policies": {"prefetch_threshold_tokens": 0},
        },
    })
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ports[0]}",
              "replay_endpoint": f"tcp://*:{ports[1]}"}
    vllm_args = [
        "--dtype", "float32", "--block-size", str(bs), "--max-model-len", str(sizes["max_model_len"]),
        "--max-num-seqs", str(args.max_parallel), "--kv-cache-memory-bytes", str(sizes["kv_cache_bytes"]),
        "--enforce-eager", "--seed", str(args.seed), "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--enable-per-request-metrics", "--disable-uvicorn-access-log", "--shutdown-timeout", "60",
        "--kv-transfer-config", json.dumps(transfer), "--kv-events-config", json.dumps(events),
    ]
    env = {
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "HICACHE_VLLM_RUNTIME_DIR": os.environ["HICACHE_VLLM_RUNTIME_DIR"],
    }
    return VllmServer(name=f"{config}-{i}", model=str(smollm2_dir()), args=vllm_args,
                      log=out / f"server-{config}-{i}.log", env=env, engine_id=engine_id,
                      start_timeout_s=args.start_timeout)


def _http(port: int, path: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


class Indexer:
    """Dynamo's standalone KV indexer, subscribed to the workers' event endpoints."""

    def __init__(self, python: str, out: Path) -> None:
        self.port = free_port()
        self._log = (out / "dynamo-indexer.log").open("wb")
        self.proc = subprocess.Popen(
            [python, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=self._log, stderr=subprocess.STDOUT, env={"DYN_LOG": "warn", "PATH": os.environ.get("PATH", "")},
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                _http(self.port, "/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"dynamo.indexer did not start (log: {out / 'dynamo-indexer.log'})") from None
                time.sleep(0.1)

    def register(self, worker: int, ports: tuple[int, int], block_size: int) -> None:
        _http(self.port, "/register", {"instance_id": worker, "endpoint": f"tcp://127.0.0.1:{ports[0]}",
                                       "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}", "block_size": block_size,
                                       "model_name": "default"})

    def overlap(self, tokens: list[int]) -> dict[int, int]:
        got = _http(self.port, "/query", {"token_ids": tokens, "model_name": "default"}) or {}
        return {int(w): int(v.get("longest_matched", 0)) for w, v in (got.get("instances") or {}).items()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class Router:
    """What the clients send to: picks a worker per request and records its predicted hit."""

    def __init__(self, clients: list[CompletionsClient], indexer: Indexer | None, block_size: int) -> None:
        self.clients = clients
        self.indexer = indexer
        self.block_size = block_size
        self.in_flight = [0] * len(clients)  # blocks of the prompts in flight on each worker
        self._turn = itertools.cycle(range(len(clients)))
        self.decisions: list[dict[str, Any]] = []

    async def generate(self, request: Any) -> Any:
        tokens = list(request.tokens)
        cap = (len(tokens) - 1) // self.block_size * self.block_size  # vLLM computes the last token
        if self.indexer is None:
            worker, overlap = next(self._turn), {}
        else:
            overlap = await anyio.to_thread.run_sync(self.indexer.overlap, tokens)
            turn = next(self._turn)
            bs = self.block_size
            blocks = -(-len(tokens) // bs)

            def cost(w: int) -> tuple[int, int]:
                return blocks - min(overlap.get(w, 0), cap) // bs + self.in_flight[w], (w - turn) % len(self.clients)

            worker = min(range(len(self.clients)), key=cost)
        predicted = min(overlap.get(worker, 0), cap) if self.indexer is not None else None
        load = -(-len(tokens) // self.block_size)
        self.in_flight[worker] += load
        try:
            try:
                result = await self.clients[worker].generate(request)
            except aiohttp.ClientOSError:
                # a keep-alive connection the server closed as it was reused: nothing was sent, so once more
                result = await self.clients[worker].generate(request)
        finally:
            self.in_flight[worker] -= load
        self.decisions.append({"tags": dict(request.tags), "worker": worker, "predicted": predicted,
                               "served": result.cached_tokens, "ttft_s": result.ttft_s,
                               "prompt_tokens": result.prompt_tokens})
        return result


async def _drive(workers: list[VllmServer], indexer: Indexer | None, workload: MultiTurn, vocab: int,
                 args: argparse.Namespace, label: str) -> dict[str, Any]:
    settings = DriverSettings(request_rate=math.inf, max_parallel=args.max_parallel, ready_queue="random",
                              round_barrier=False, seed=args.seed, page_size=args.block_size)
    async with CompletionsClient(workers[0].url, workers[0].model, id_prefix=f"{label}-0") as c0, \
            CompletionsClient(workers[1].url, workers[1].model, id_prefix=f"{label}-1") as c1:
        router = Router([c0, c1], indexer, args.block_size)
        started = time.perf_counter()
        await drive(router, workload.conversations(vocab), settings)
        wall = time.perf_counter() - started
    return {"decisions": router.decisions, "wall_s": wall}


def _summary(decisions: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [d["ttft_s"] for d in decisions]
    served = sum(d["served"] for d in decisions)
    out: dict[str, Any] = {
        "requests": len(decisions),
        "mean_ttft_s": statistics.fmean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "hit_tokens": served,
        "prompt_tokens": sum(d["prompt_tokens"] for d in decisions),
        "per_worker": [sum(1 for d in decisions if d["worker"] == w) for w in (0, 1)],
    }
    if decisions and decisions[0]["predicted"] is not None:
        err = sum(abs(d["predicted"] - d["served"]) for d in decisions)
        out["predicted_tokens"] = sum(d["predicted"] for d in decisions)
        out["prediction_error"] = err / max(1, served)
        out["exact_predictions"] = sum(1 for d in decisions if d["predicted"] == d["served"])
    return out


def run_route_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hicache bench route needs vLLM: run it from .venv-vllm")
    python = args.dynamo_python or str(_REPO / ".venv-dynamo" / "bin" / "python")
    if not Path(python).exists():
        raise SystemExit(f"hicache bench route needs Dynamo's indexer: {python} is missing (`make venv-dynamo`)")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown:
        raise SystemExit(f"unknown configuration(s) {unknown}; known: {list(CONFIGURATIONS)}")
    out = Path(args.out or "bench-results/route")
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HICACHE_VLLM_RUNTIME_DIR", str(out / "run"))
    workload = MultiTurn(clients=args.num_clients, rounds=args.num_rounds, request_len=args.request_length,
                         output_len=args.output_length, seed=args.seed)
    geo = _geometry(smollm2_dir())
    sizes = _sizes(args, workload, geo["token_bytes"])
    print(f"hicache bench route: {workload}; {workload.requests} requests, history {sizes['history_tokens']:,} tokens; "
          f"each worker: vLLM KV {sizes['vllm_blocks'] * args.block_size:,} tokens "
          f"({sizes['vllm_blocks'] * args.block_size / sizes['history_tokens']:.0%} of the history), hicache host "
          f"{sizes['host_bytes'] // geo['token_bytes']:,} tokens and a file tier of its own of "
          f"{sizes['file_bytes'] // geo['token_bytes']:,}", file=sys.stderr)
    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        results: dict[str, Any] = {}
        for config in configs:
            ports = [(_free(), _free()) for _ in range(2)]
            workers = [_worker(args, config, i, sizes, out, ports[i]) for i in range(2)]
            with ExitStack() as stack:
                for w in workers:
                    w.launch()
                    stack.callback(w.stop)
                for w in workers:
                    w.wait_ready()
                indexer = None
                if config != "round-robin":
                    indexer = Indexer(python, out)
                    stack.callback(indexer.stop)
                    for i, p in enumerate(ports):
                        indexer.register(i, p, args.block_size)
                result = anyio.run(_drive, workers, indexer, workload, geo["vocab"], args, f"r{run}-{config}")
            result["summary"] = _summary(result["decisions"])
            results[config] = result
            s = result["summary"]
            err = f", prediction error {s['prediction_error']:.2%}" if "prediction_error" in s else ""
            print(f"  run {run + 1} {config:>18}: mean TTFT {s['mean_ttft_s'] * 1e3:7.1f} ms, median "
                  f"{s['median_ttft_s'] * 1e3:7.1f} ms, hit {s['hit_tokens']:,} of {s['prompt_tokens']:,} tokens, "
                  f"requests per worker {s['per_worker']}{err}", file=sys.stderr)
        runs.append(results)
        _print_targets(run, results)
        (out / "results.json").write_text(json.dumps({"sizes": sizes, "runs": runs}, indent=1, default=str))
    (out / "results.json").write_text(json.dumps({"sizes": sizes, "runs": runs}, indent=1, default=str))
    return {"sizes": sizes, "runs": runs}


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _print_targets(run: int, results: dict[str, Any]) -> None:
    s = {c: r["summary"] for c, r in results.items()}
    lines = []
    if "kv-hicache-events" in s:
        h = s["kv-hicache-events"]["mean_ttft_s"]
        if "round-robin" in s:
            ratio = s["round-robin"]["mean_ttft_s"] / h
            lines.append(f"round-robin / kv-hicache-events mean TTFT {ratio:.2f} (target >= 1.5: "
                         f"{'met' if ratio >= 1.5 else 'missed'})")
        if "kv-vllm-events" in s:
            ratio = s["kv-vllm-events"]["mean_ttft_s"] / h
            lines.append(f"kv-vllm-events / kv-hicache-events mean TTFT {ratio:.2f} (target > 1: "
                         f"{'met' if ratio > 1 else 'missed'})")
        err = s["kv-hicache-events"].get("prediction_error", 0.0)
        lines.append(f"kv-hicache-events prediction error {err:.2%} (target <= 2%: {'met' if err <= 0.02 else 'missed'})")
    for line in lines:
        print(f"  run {run + 1}: {line}", file=sys.stderr)
