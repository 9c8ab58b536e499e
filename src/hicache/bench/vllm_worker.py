"""Runs one configuration of ``hicache bench vllm`` in this process: ``python -m hicache.bench.vllm_worker OUT.json``.

The trace's conversations go through vLLM's ``LLMEngine`` (single-process mode unless the spec says
``multi``): a ready queue and a cap on requests in flight, as ``driver.py`` does for the reference
engine, stepping the engine and sending a conversation's next turn when its answer arrives. TTFT
and queueing come from vLLM's request metrics; cached tokens from vLLM's output (its own prefix
cache plus what the connector loaded), split by tier with the connector's per-request records.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..integrations.vllm.profile import threads_cpu_seconds
from .driver import Record, _Seen
from .vllm_turns import TurnPipe
from .workloads import MultiTurn

__all__ = ["run_configuration"]


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if spec["connector"] is not None:
        ktc = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    kwargs: dict[str, Any] = {}
    if spec["vllm_mode"] == "single":
        kwargs["distributed_executor_backend"] = "uni"
    return LLM(
        model=spec["model_dir"],
        dtype="float32",
        block_size=spec["block_size"],
        max_model_len=spec["max_model_len"],
        max_num_seqs=spec["max_running"],
        enforce_eager=True,
        seed=spec["seed"],
        kv_cache_memory_bytes=spec["kv_cache_bytes"],
        enable_prefix_caching=True,
        disable_log_stats=False,
        kv_transfer_config=ktc,
        **kwargs,
    )


def _warm_up(llm: Any, vocab: int) -> None:
    from vllm import SamplingParams

    prompt = [100 + i % (vocab - 100) for i in range(64)]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    llm.reset_prefix_cache()


def run_configuration(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    llm = _llm(spec)
    engine = llm.llm_engine
    vocab = llm.llm_engine.model_config.get_vocab_size()
    workload = MultiTurn(**spec["workload"])
    conversations = workload.conversations(vocab)
    _warm_up(llm, vocab)
    cpu_before = _tree_cpu_seconds()
    single = spec["vllm_mode"] == "single"
    threads_before = threads_cpu_seconds() if single else {}  # the cache's threads live here in single mode
    channel = None
    if spec["connector"] is not None:
        from ..integrations.vllm import ChannelClient, socket_path

        channel = ChannelClient(socket_path(engine.vllm_config.kv_transfer_config.engine_id))
        channel.call({"op": "wait_idle"})
        base_records = set((channel.call({"op": "stats"}) or {}).get("requests", {}))
    turns = TurnPipe.from_spec(spec.get("turns"))  # --interleave: one request a turn, granted by the parent
    if turns is not None and spec["max_parallel"] != 1:
        raise SystemExit("--interleave takes turns one request at a time (--max-parallel 1)")
    drain = None if channel is None else (lambda: channel.call({"op": "wait_idle"}))
    rng = random.Random(spec["seed"])
    ready = list(conversations)
    in_flight: dict[str, tuple[Any, int, list[int], int, float]] = {}
    seen = _Seen()
    done: list[tuple[str, Any, int, list[int], int, float, float, Any]] = []
    bar = None
    if spec.get("progress", True):
        from tqdm import tqdm

        bar = tqdm(total=workload.requests, desc=f"{spec['configuration']:>13}", unit="req", file=sys.stderr)
    if turns is not None:
        turns.ready()
    started = time.perf_counter()
    sp = SamplingParams(max_tokens=workload.output_len, temperature=0, ignore_eos=True)
    while ready or in_flight:
        while ready and len(in_flight) < spec["max_parallel"]:
            if turns is not None:
                turns.acquire()
            conv = ready.pop(rng.randrange(len(ready)) if spec["ready_queue"] == "random" else 0)
            prompt = conv.next_prompt()
            ideal = seen.longest_prefix(prompt)
            seen.add(prompt)
            rid = f"c{conv.id}_r{conv.turn}"
            engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
            in_flight[rid] = (conv, conv.rounds[conv.turn], prompt, ideal, time.perf_counter() - started)
        for out in engine.step():
            if not out.finished or out.request_id not in in_flight:
                continue
            conv, round_, prompt, ideal, arrival = in_flight.pop(out.request_id)
            output = list(out.outputs[0].token_ids)
            finished = time.perf_counter() - started
            done.append((out.request_id, conv, round_, prompt, ideal, arrival, finished, out))
            seen.add(prompt + output)
            conv.advance(prompt, output)
            if not conv.done:
                ready.append(conv)
            if turns is not None:
                turns.release(drain)
            if bar is not None:
                bar.update(1)
    wall = time.perf_counter() - started if turns is None else turns.busy_s
    cpu_after = _tree_cpu_seconds()
    threads_after = threads_cpu_seconds() if single else {}
    if bar is not None:
        bar.close()
    stats = None
    loads: dict[str, Any] = {}
    if channel is not None:
        channel.call({"op": "wait_idle"})
        stats = channel.call({"op": "stats"})
        loads = {k: v for k, v in (stats or {}).get("requests", {}).items() if k not in base_records}
    records = [_record(*entry, loads) for entry in done]
    return {
        "configuration": spec["configuration"],
        "wall_s": wall,  # interleaved: its own turns' time
        "drain_s": [] if turns is None else turns.drain_s,
        "records": [asdict(r) for r in records],
        "cache_stats": stats,
        "cpu_s": {k: cpu_after.get(k, 0.0) - v for k, v in cpu_before.items()},
        # single-process mode: this process's threads by role (vLLM's main thread and OpenMP threads,
        # the cache's loop and I/O threads), during the trace
        "threads_cpu_s": {k: v - threads_before.get(k, 0.0) for k, v in threads_after.items()},
        "vllm": {"kv_cache_bytes": spec["kv_cache_bytes"], "block_size": spec["block_size"],
                 "max_model_len": spec["max_model_len"], "mode": spec["vllm_mode"],
                 "reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU")},
    }


def _tree_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) of this process and of vLLM's processes under it, by role."""
    import psutil

    out: dict[str, float] = {}
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            title = proc.name()
            name = ("driver" if proc.pid == me.pid else "worker" if "Worker" in title
                    else "engine_core" if "Engine" in title else "other")
        except psutil.Error:
            continue
        out[name] = out.get(name, 0.0) + t.user + t.system
    out["total"] = sum(out.values())
    return out


def _record(rid: str, conv: Any, round_: int, prompt: list[int], ideal: int, arrival: float, finished: float,
            out: Any, loads: dict[str, Any]) -> Record:
    m = out.metrics
    output = list(out.outputs[0].token_ids)
    cached = int(out.num_cached_tokens or 0)
    load = next((v for k, v in loads.items() if k == rid or k.startswith(rid + "-")), None)
    by_tier = {"vllm": cached}
    if load is not None:
        ext = int(load["loaded_tokens"])
        by_tier = {"vllm": max(cached - ext, 0)} | {t: int(n) for t, n in load["by_tier"].items()}
    n = len(output)
    itl = [(m.last_token_ts - m.first_token_ts) / (n - 1)] * (n - 1) if n > 1 else []
    return Record(
        conversation=conv.id,
        round=round_,
        prompt_tokens=len(prompt),
        cached_tokens=cached,
        ideal_tokens=ideal,
        by_tier=by_tier,
        ttft_s=float(m.first_token_latency),
        queue_s=float(m.scheduled_ts - m.queued_ts),
        prefill_s=float(m.first_token_ts - m.scheduled_ts),
        itl_s=itl,
        arrival_s=arrival,
        finished_s=finished,
        output=output,
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hicache.bench.vllm_worker OUT.json < spec.json", file=sys.stderr)
        return 2
    spec = json.loads(sys.stdin.read())
    result = run_configuration(spec)
    Path(argv[0]).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    _kill_children()  # multi-process mode: vLLM's engine core and worker would outlive os._exit
    os._exit(0)  # the results are written; skip vLLM's slow interpreter teardown


def _kill_children() -> None:
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            child.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    sys.exit(main())
