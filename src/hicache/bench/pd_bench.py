"""``hicache bench pd``: prefill/decode disaggregation with ``vllm serve``, through hicache and through
vLLM's own connectors, against one server alone.

Per configuration, a prefill and a decode ``vllm serve`` (SmolLM2-135M fp32, on loopback, started
side by side) behind ``hicache pd-proxy`` run the multi-turn and the long-context workloads of
``hicache bench serve`` one after the other (their prompts share nothing), driven over HTTP by the
same streaming clients (TTFT and inter-token latency at the client). Configurations:

* ``alone``: one ``vllm serve``, its prefix cache on, no proxy: what PD is measured against;
* ``hicache-valkey``, ``hicache-mooncake``, ``hicache-nixl``: ``HiCacheConnector`` on both servers
  (``kv_both`` prefill, ``kv_consumer`` decode, ``config/vllm-pd.yaml``), the KV crossing through a
  Valkey server, a Mooncake Store (master on loopback, each server lending memory) or the
  prefill server's own memory read over UCX (``kind: nixl-peer``, no store between);
* ``example``: vLLM's ``ExampleConnector``: safetensors files per layer in a shared folder;
* ``nixl-connector`` (not run by default): vLLM's ``NixlConnector`` on its CPU path.

For the hicache configurations the hand-off's cost is read from the servers' own counters over
each workload: the bytes the prefill server wrote to the tier and the decode server read from it,
the seconds those backend calls took, and the decode server's copies into vLLM's blocks; the raw
cost of the same bytes is their size at the tier's raw write and read bandwidth, measured by
``pd_tiers.py`` before the servers start, with the raw client on the same server and page size,
and again every ``--raw-every-s`` while each workload runs (``LoadedRaw``: the same contention as
the servers' own calls). A backend's seconds are its busy time (wall time with a call in flight:
calls overlap). ``transfer_vs_raw`` is raw seconds over hicache's, ``transfer_vs_raw_loaded`` the
same against the raw figure taken under load (target >= 0.8). Every configuration runs with
the same ``VLLM_CPU_NUM_OF_RESERVED_CPU`` and KV memory per server; greedy outputs are checked
against ``alone``'s. Output in ``--out`` (``bench-results/pd-smollm2/``): the tables, ``results.json``,
each server's log and scrapes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .driver import DriverSettings
from .models import smollm2_dir
from .pd_tiers import LoadedRaw, SharedTier, start_tier
from .profiling import cpu_pressure
from .report import _grid, outputs_of, summarise
from .scratch import add_keep_pages_argument, pages_removed
from .serve_bench import add_workload_arguments, longest_context, serve_sizes, workload_of
from .serve_run import run_workload
from .vllm_bench import _finite, _geometry
from .vllm_server import ProxyProcess, ServerSet, VllmServer, free_port, hicache_transfer
from .workloads import LongContext, MultiTurn

__all__ = ["CONFIGURATIONS", "DEFAULT_CONFIGURATIONS", "add_parser", "run_pd_benchmark"]

CONFIGURATIONS = ("alone", "hicache-valkey", "hicache-mooncake", "hicache-nixl", "example", "nixl-connector")
DEFAULT_CONFIGURATIONS = CONFIGURATIONS[:-1]
WORKLOADS = ("multiturn", "long-context")
_TIERS = {"hicache-valkey": "valkey", "hicache-mooncake": "mooncake", "hicache-nixl": "nixl"}

MULTITURN = MultiTurn(clients=8, rounds=4, request_len=512, output_len=16)
LONG_CONTEXT = LongContext(documents=8, document_len=1536, questions=4, question_len=64, output_len=16)
REPO = Path(__file__).resolve().parents[3]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("pd", help="prefill/decode disaggregation over vllm serve: hicache (Valkey, Mooncake, NIXL) "
                                  "against vLLM's ExampleConnector and one server alone (needs vLLM)")
    add_workload_arguments(p, MULTITURN, LONG_CONTEXT)
    g = p.add_argument_group("run")
    g.add_argument("--configs", default=",".join(DEFAULT_CONFIGURATIONS),
                   help=f"comma-separated, in run order, from {', '.join(CONFIGURATIONS)}")
    g.add_argument("--out", default=None, help="folder for the results, logs and scrapes")
    add_keep_pages_argument(g)
    g.add_argument("--max-running", type=int, default=None, help="vLLM's --max-num-seqs (default: --max-parallel)")
    g.add_argument("--kv-fraction", type=float, default=0.25,
                   help="each server's KV memory / the workload's KV, at least the running batch at the longest context")
    g.add_argument("--host-fraction", type=float, default=0.5, help="hicache's host tier / the workload's KV")
    g.add_argument("--block-size", type=int, default=128, help="vLLM's block size (hicache's page size follows it)")
    g.add_argument("--reserved-cpus", type=int, default=1, help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server")
    g.add_argument("--receive-timeout", type=float, default=30.0, help="a decode server's bound on a hand-off (s)")
    g.add_argument("--raw-pages", type=int, default=32, help="pages of the raw tier measurement")
    g.add_argument("--raw-pages-loaded", type=int, default=8,
                   help="pages of each raw tier measurement taken while a workload runs (every --raw-every-s)")
    g.add_argument("--raw-every-s", type=float, default=15.0, help="seconds between those measurements")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    g.add_argument("--quiet", action="store_true", help="no progress bars")


# -- the servers of a configuration ------------------------------------------------------------------


def _vllm_args(args: argparse.Namespace, sizes: dict[str, int]) -> list[str]:
    return [
        "--dtype", "float32", "--block-size", str(args.block_size), "--max-model-len", str(sizes["max_model_len"]),
        "--max-num-seqs", str(args.max_running or args.max_parallel), "--kv-cache-memory-bytes",
        str(sizes["kv_cache_bytes"]), "--enforce-eager", "--seed", str(args.seed), "--enable-prefix-caching",
        "--enable-prompt-tokens-details", "--enable-per-request-metrics", "--disable-uvicorn-access-log",
        "--shutdown-timeout", "60",
    ]


def _env(args: argparse.Namespace, **more: str) -> dict[str, str]:
    return {
        "OMP_WAIT_POLICY": "PASSIVE",
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus),  # the same for every server
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "30",
        "HICACHE_VLLM_RUNTIME_DIR": os.environ["HICACHE_VLLM_RUNTIME_DIR"],
        **more,
    }


def _hicache_transfer(role: str, engine_id: str, tier: SharedTier, sizes: dict[str, int],
                      args: argparse.Namespace) -> dict[str, Any]:
    side = "prefill" if role == "kv_both" else "decode"
    return hicache_transfer(engine_id, {
        "config": str(_pd_config()),
        "metrics_port": 0,
        "pd": {"tier": "shared", "receive_timeout_s": args.receive_timeout, "send_timeout_s": 60},
        "overrides": {"tiers": {
            "host": {"capacity": sizes["host_bytes"], "pin_memory": False},
            "storage": [tier.entry(side, sizes["file_bytes"])],
        }},
    }, role=role)


def _pd_config() -> Path:
    path = REPO / "config" / "vllm-pd.yaml"
    if not path.exists():
        raise SystemExit(f"hicache bench pd: {path} not found (run it from a checkout)")
    return path


def servers_for(config: str, args: argparse.Namespace, sizes: dict[str, int], out: Path,
                tier: SharedTier | None) -> ServerSet:
    """The servers (and the proxy) of ``config``."""
    model = str(smollm2_dir())
    base = _vllm_args(args, sizes)
    if config == "alone":
        return ServerSet([VllmServer("alone", model, base, out / "server-alone.log", _env(args),
                                     start_timeout_s=args.start_timeout)])
    pair: list[VllmServer] = []
    for name, role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        label = f"{config}-{name}"
        env = _env(args)
        engine_id = None
        if config in _TIERS:
            assert tier is not None
            role = "kv_both" if name == "prefill" else role  # the prefill server keeps its own cache too
            engine_id = f"hicache-bench-pd-{os.getpid()}-{label}"
            transfer = _hicache_transfer(role, engine_id, tier, sizes, args)
        elif config == "example":
            folder = out / "example-kv"
            transfer = {"kv_connector": "ExampleConnector", "kv_role": role,
                        "kv_connector_extra_config": {"shared_storage_path": str(folder)}}
        else:  # nixl-connector
            transfer = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu"}
            env |= {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        pair.append(VllmServer(name, model, [*base, "--kv-transfer-config", json.dumps(transfer)],
                               out / f"server-{label}.log", env, engine_id=engine_id,
                               start_timeout_s=args.start_timeout, port=free_port()))
    proxy = ProxyProcess([pair[0].url], [pair[1].url], out / f"proxy-{config}.log")
    return ServerSet(pair, side_by_side=True, proxy=proxy)


# -- the hand-off's cost -------------------------------------------------------------------------------


def _storage(stats: dict[str, Any] | None) -> dict[str, Any]:
    return (((stats or {}).get("cache") or {}).get("storage") or {}).get("shared") or {}


def _cache_count(stats: dict[str, Any] | None, key: str) -> float:
    return float(((stats or {}).get("cache") or {}).get(key) or 0)


def _backend(stats: dict[str, Any] | None, key: str, verb: str | None = None) -> float:
    b = _storage(stats).get("backend") or {}
    return float((b.get(key) or {}).get(verb, 0.0)) if verb else float(b.get(key) or 0.0)


def transfer_cost(before: dict[str, Any], after: dict[str, Any], raw: dict[str, float], token_bytes: int,
                  loaded: dict[str, float] | None = None) -> dict[str, Any]:
    """What the hand-offs of one workload moved and took, on each server, against the raw tier
    (``raw``: measured before the servers start; ``loaded``: while the workload ran)."""
    p0, p1 = before.get("prefill") or {}, after.get("prefill") or {}
    d0, d1 = before.get("decode") or {}, after.get("decode") or {}
    c0, c1 = d0.get("connector") or {}, d1.get("connector") or {}
    s0, s1 = p0.get("connector") or {}, p1.get("connector") or {}

    def delta(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
        return float(b.get(key, 0) or 0) - float(a.get(key, 0) or 0)

    handoffs = delta(c0, c1, "pd_receives") + delta(c0, c1, "pd_receive_failures")
    written = _backend(p1, "bytes_written") - _backend(p0, "bytes_written")
    read = _backend(d1, "bytes_read") - _backend(d0, "bytes_read")
    # Wall time with a call in flight (several run at once: summing each call's time would count
    # the overlap twice); the summed call time is kept beside it.
    set_s = _backend(p1, "busy_seconds", "set") - _backend(p0, "busy_seconds", "set")
    get_s = _backend(d1, "busy_seconds", "get") - _backend(d0, "busy_seconds", "get")
    summed = (_backend(p1, "seconds", "set") - _backend(p0, "seconds", "set")
              + _backend(d1, "seconds", "get") - _backend(d0, "seconds", "get"))
    copy_s = delta(c0, c1, "pd_copy_s")
    # Calls and pages each way: how the bytes were batched (the raw client moves 8 pages a call).
    set_calls = _backend(p1, "calls", "set") - _backend(p0, "calls", "set")
    get_calls = _backend(d1, "calls", "get") - _backend(d0, "calls", "get")
    pages_in = _backend(p1, "pages_written") - _backend(p0, "pages_written")
    pages_out = _backend(d1, "pages_read") - _backend(d0, "pages_read")
    ours = set_s + get_s + copy_s
    raw_s = written / 1e9 / raw["write_gbps"] + read / 1e9 / raw["read_gbps"]
    loaded_s = (written / 1e9 / loaded["write_gbps"] + read / 1e9 / loaded["read_gbps"]) if loaded else math.nan
    n = max(handoffs, 1)
    sends = delta(s0, s1, "pd_sends") + delta(s0, s1, "pd_send_failures")
    return {
        "handoffs": int(handoffs),
        "received_failures": int(delta(c0, c1, "pd_receive_failures")),
        "refused": int(delta(c0, c1, "pd_receives_refused")),
        "rereads": int(delta(c0, c1, "pd_receive_retries")),
        # Receives ended before their bound: by the producer's gave-up marker, or by its silence
        # (no pulse); a live producer's receive ended by silence would be a false alarm.
        "ended_by_marker": int(delta(c0, c1, "pd_receives_given_up")),
        "ended_by_silence": int(delta(c0, c1, "pd_receives_producer_silent")),
        "send_failures": int(delta(s0, s1, "pd_send_failures")),
        # Pages the prefill server's cache could not place (no room): not handed off, recomputed.
        "producer_dropped_pages": int(_cache_count(p1, "dropped_pages") - _cache_count(p0, "dropped_pages")),
        "handed_bytes_per_request": delta(c0, c1, "pd_received_tokens") * token_bytes / n,
        "written_bytes_per_request": written / n,
        "read_bytes_per_request": read / n,
        "write_s_per_request": set_s / n,
        "read_s_per_request": get_s / n,
        "copy_s_per_request": copy_s / n,
        "pages_per_write_call": pages_in / set_calls if set_calls else math.nan,
        "pages_per_read_call": pages_out / get_calls if get_calls else math.nan,
        "exists_calls_per_request": (_backend(d1, "calls", "exists") - _backend(d0, "calls", "exists")) / n,
        "transfer_s_per_request": ours / n,
        "summed_call_s_per_request": summed / n,
        "raw_s_per_request": raw_s / n,
        "transfer_vs_raw": raw_s / ours if ours > 0 else math.nan,
        "raw_loaded_s_per_request": loaded_s / n,
        "transfer_vs_raw_loaded": loaded_s / ours if ours > 0 else math.nan,
        "raw_loaded": loaded,
        "send_latency_s": delta(s0, s1, "pd_send_s") / max(sends, 1),
        "receive_wait_s": delta(c0, c1, "pd_receive_wait_s") / n,
        "raw": raw,
    }


# -- running -----------------------------------------------------------------------------------------


def _driver_settings(args: argparse.Namespace, name: str) -> DriverSettings:
    return DriverSettings(
        request_rate=args.request_rate if name == "multiturn" else math.inf,
        max_parallel=args.max_parallel,
        ready_queue=args.ready_queue_policy if name == "multiturn" else "fifo",
        round_barrier=args.round_barrier and name == "multiturn",
        seed=args.seed,
        page_size=args.block_size,
    )


def _sizes(args: argparse.Namespace, workloads: dict[str, MultiTurn | LongContext], token_bytes: int) -> dict[str, int]:
    """One server set runs every workload: each size is the largest any of them needs."""
    per = [serve_sizes(args, w, token_bytes) for w in workloads.values()]
    out = {k: max(s[k] for s in per) for k in per[0]}
    out["max_model_len"] = math.ceil(max(longest_context(w) for w in workloads.values()) / args.block_size) * args.block_size
    # A prefill server's host holds two running batches at once: the prompts being saved (reserved)
    # and those of the hand-offs still being made durable (pinned until the shared tier holds
    # them). With room for one, a store finds every page pinned and drops what does not fit
    # (counted: ``dropped_pages``), and the decode server recomputes it.
    bs = args.block_size
    page_bytes = out["host_bytes"] // (out["host_tokens"] // bs)
    host_pages = max(out["host_tokens"] // bs, 2 * out["running"] * out["max_model_len"] // bs + 1)
    out["host_tokens"], out["host_bytes"] = host_pages * bs, host_pages * page_bytes
    return out


def run_config(config: str, args: argparse.Namespace, workloads: dict[str, MultiTurn | LongContext],
               sizes: dict[str, int], geo: dict[str, Any], out: Path) -> dict[str, Any]:
    tier = start_tier(_TIERS[config], out / f"tier-{config}") if config in _TIERS else None
    results: dict[str, Any] = {}
    try:
        raw = None
        page = args.block_size * geo["token_bytes"]
        if tier is not None:
            raw = tier.raw(page, args.raw_pages, batch=8)
            print(f"  {config}: raw {tier.kind} write {raw['write_gbps']:.2f} GB/s, read {raw['read_gbps']:.2f} GB/s "
                  f"({args.raw_pages} pages of {page / 2**20:.1f} MiB, 8 a call)", file=sys.stderr)
        if config == "example":
            shutil.rmtree(out / "example-kv", ignore_errors=True)
        servers = servers_for(config, args, sizes, out, tier)
        started = time.monotonic()
        with servers:
            start_s = time.monotonic() - started
            for name, workload in workloads.items():
                label = f"{name}-{config}"
                before = _snapshots(servers)
                sources_before = _by_source(servers.servers[-1])
                sampler = (LoadedRaw(tier, page, args.raw_pages_loaded, args.raw_every_s, _cache_cpus(servers))
                           if tier is not None else None)
                try:
                    result = run_workload(servers, workload.conversations(geo["vocab"]), _driver_settings(args, name),
                                          out=out, label=label, vocab=geo["vocab"], progress=not args.quiet)
                finally:
                    loaded = sampler.stop() if sampler is not None else None
                after = _snapshots(servers)
                sources_after = _by_source(servers.servers[-1])
                result["decode_prompt_tokens_by_source"] = {
                    k: v - sources_before.get(k, 0.0) for k, v in sources_after.items()}
                if raw is not None:
                    result["transfer"] = transfer_cost(before, after, raw, geo["token_bytes"], loaded)
                if config == "example":
                    result["example_folder_bytes"] = _folder_bytes(out / "example-kv")
                result["proxy"] = servers.proxy.health() if servers.proxy is not None else None
                result["cpu_pressure"] = cpu_pressure()
                result["start_s"] = start_s
                results[name] = result
    finally:
        if tier is not None:
            tier.stop()
    return results


_CACHE_CPUS = re.compile(r"hicache: the cache's threads run on CPUs \[([0-9, ]+)\]")


def _cache_cpus(servers: ServerSet) -> set[int] | None:
    """The CPUs the servers' cache threads are bound to (vLLM's reserved cores, from their logs):
    where the raw figure under load is measured too."""
    found: set[int] = set()
    for server in servers.servers:
        try:
            text = server.log.read_text(errors="replace")
        except OSError:
            continue
        for m in _CACHE_CPUS.finditer(text):
            found |= {int(c) for c in m.group(1).split(",")}
    return found or None


def _snapshots(servers: ServerSet) -> dict[str, Any]:
    out = {}
    for s in servers.servers:
        if s.engine_id is not None:
            s.channel_call({"op": "wait_idle", "timeout_s": 120})
            out[s.name] = s.channel_call({"op": "stats"})
    return out


def _by_source(server: VllmServer) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source`` on the server that answers (the decode server; the
    only one alone): prompt tokens computed there, hit in its own prefix cache, or transferred. The
    clients' ``cached_tokens`` do not count a transfer vLLM waited for asynchronously, so what a
    decode server computed is read here."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(server.scrape()):
        if family.name == "vllm:prompt_tokens_by_source":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["source"]] = out.get(sample.labels["source"], 0.0) + sample.value
    return out


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0


def summarise_workload(name: str, runs: dict[str, dict[str, Any]], base: str) -> dict[str, Any]:
    summaries: dict[str, dict[str, Any]] = {}
    for config, r in runs.items():
        s = summarise(r["records"], r["wall_s"])
        s["requests_per_s"] = s["requests"] / s["duration_s"]
        sources = r.get("decode_prompt_tokens_by_source") or {}
        if "local_compute" in sources:  # what the answering server computed, transfers counted as not
            s["computed_tokens_per_request"] = sources["local_compute"] / max(1, s["requests"])
            s["decode_prompt_tokens_by_source"] = sources
        else:
            s["computed_tokens_per_request"] = (s["input_tokens"] - s["cached_tokens"]) / max(1, s["requests"])
        if "transfer" in r:
            s["transfer"] = r["transfer"]
        summaries[config] = s
    reference = outputs_of(runs[base]["records"]) if base in runs else {}
    for config, r in runs.items():
        summaries[config][f"outputs_differ_from_{base}"] = sum(
            1 for k, v in outputs_of(r["records"]).items() if reference.get(k) != v)
    return {"workload": name, "summary": summaries, "targets": check_targets(summaries, base)}


def check_targets(summaries: dict[str, dict[str, Any]], base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    example = summaries.get("example")
    for config, s in summaries.items():
        t = s.get("transfer")
        if t is not None:
            v = t["transfer_vs_raw"]
            out[f"{config}: transfer_vs_raw"] = {"value": v, "target": ">= 0.8", "met": v == v and v >= 0.8}
            v = t.get("transfer_vs_raw_loaded", math.nan)
            out[f"{config}: transfer_vs_raw_loaded"] = {"value": v, "target": ">= 0.8", "met": v == v and v >= 0.8}
            if example is not None:
                ratio = s["ttft_s"]["mean"] / example["ttft_s"]["mean"]
                out[f"{config}: ttft_over_example"] = {"value": ratio, "target": "<= 1.0", "met": ratio <= 1.0}
    differ = sum(s.get(f"outputs_differ_from_{base}", 0) for s in summaries.values())
    out["outputs_differing"] = {"value": differ, "target": "== 0", "met": differ == 0}
    return out


# -- the report --------------------------------------------------------------------------------------


def _ms(x: float) -> str:
    return "-" if x != x else f"{x * 1000:,.0f}"


def format_workload(w: dict[str, Any]) -> str:
    rows = [["config", "req/s", "out tok/s", "TTFT mean", "p50", "p90", "p99", "ITL p50", "p99", "computed/req",
             "differ"]]
    for name, s in w["summary"].items():
        t, itl = s["ttft_s"], s["itl_s"]
        rows.append([name, f"{s['requests_per_s']:.3f}", f"{s['output_tok_s']:,.1f}", _ms(t["mean"]), _ms(t["p50"]),
                     _ms(t["p90"]), _ms(t["p99"]), _ms(itl["p50"]), _ms(itl["p99"]),
                     f"{s['computed_tokens_per_request']:,.0f}",
                     str(next((v for k, v in s.items() if k.startswith("outputs_differ_from_")), 0))])
    lines = [f"== {w['workload']} (ms; TTFT and ITL at the client) ==", _grid(rows), ""]
    moves = [["hand-off (per request)", "MB handed", "MB written", "MB read", "write ms", "read ms", "copy ms",
              "total ms", "raw ms", "x raw", "raw loaded ms", "x raw loaded", "send ms", "receive ms", "failed",
              "refused", "rereads", "ended: marker/silence", "dropped"]]
    for name, s in w["summary"].items():
        t = s.get("transfer")
        if t is None:
            continue
        moves.append([name, f"{t['handed_bytes_per_request'] / 1e6:.1f}", f"{t['written_bytes_per_request'] / 1e6:.1f}",
                      f"{t['read_bytes_per_request'] / 1e6:.1f}", _ms(t["write_s_per_request"]),
                      _ms(t["read_s_per_request"]), _ms(t["copy_s_per_request"]), _ms(t["transfer_s_per_request"]),
                      _ms(t["raw_s_per_request"]), f"{t['transfer_vs_raw']:.2f}",
                      _ms(t.get("raw_loaded_s_per_request", math.nan)), f"{t.get('transfer_vs_raw_loaded', math.nan):.2f}",
                      _ms(t["send_latency_s"]),
                      _ms(t["receive_wait_s"]), str(t["received_failures"]), str(t["refused"]),
                      str(t.get("rereads", 0)), f"{t.get('ended_by_marker', 0)}/{t.get('ended_by_silence', 0)}",
                      str(t.get("producer_dropped_pages", 0))])
    if len(moves) > 1:
        lines += [_grid(moves), ""]
    for key, t in w["targets"].items():
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        lines.append(f"  {key}: {shown} (target {t['target']}): {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_first_line(e) for e in exc.exceptions)
    return (str(exc).splitlines() or [""])[0][:300]


def run_pd_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("hicache bench pd needs vLLM: run it from .venv-vllm")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGURATIONS]
    if unknown or not configs:
        raise SystemExit(f"unknown configuration(s) {unknown}; choose from {', '.join(CONFIGURATIONS)}")
    out = Path(args.out or "bench-results/pd-smollm2").resolve()
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    os.environ.setdefault("HICACHE_VLLM_RUNTIME_DIR", str(out / "run"))
    names = list(WORKLOADS) if args.workload == "both" else [args.workload]
    workloads = {n: workload_of(args, n) for n in names}
    geo = _geometry(smollm2_dir())
    sizes = _sizes(args, workloads, geo["token_bytes"])
    print(f"hicache bench pd: {', '.join(f'{n} {w.requests} requests' for n, w in workloads.items())}; per server "
          f"KV {sizes['vllm_kv_tokens']:,} tokens, hicache host {sizes['host_tokens']:,}; configurations "
          f"{', '.join(configs)}; VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}", file=sys.stderr)
    report: dict[str, Any] = {
        "benchmark": "pd", "configurations": configs, "sizes": sizes,
        "workload_settings": {n: {k: getattr(w, k) for k in w.__dataclass_fields__} for n, w in workloads.items()},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "cpu_pressure_at_start": cpu_pressure()},
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "runs": {}, "workloads": {},
    }
    failed: dict[str, str] = {}
    with pages_removed([out / "example-kv"], args.keep_pages):
        for config in configs:
            print(f"hicache bench pd: {config}", file=sys.stderr)
            try:
                report["runs"][config] = run_config(config, args, workloads, sizes, geo, out)
            except Exception as exc:  # one configuration's failure is reported; the others still run
                failed[config] = f"{type(exc).__name__}: {_first_line(exc)}"
                print(f"hicache bench pd: {config} FAILED: {failed[config]} (its servers' logs are in {out})",
                      file=sys.stderr)
            partial = json.dumps(_finite(report | {"failed": failed}), indent=1, allow_nan=False)
            (out / "results.json").write_text(partial)
    report["failed"] = failed
    ran = [c for c in configs if c not in failed]
    base = ran[0] if ran else configs[0]
    for name in names if ran else []:
        runs = {c: report["runs"][c][name] for c in ran}
        report["workloads"][name] = summarise_workload(name, runs, base)
        print(format_workload(report["workloads"][name]))
        print()
    for config, why in failed.items():
        print(f"  {config}: FAILED ({why})")
    report["machine"]["cpu_pressure_at_end"] = cpu_pressure()
    (out / "results.json").write_text(json.dumps(_finite(report), indent=1, allow_nan=False))
    print(f"wrote {out / 'results.json'}, the servers' logs and scrapes in {out}")
    return report
