"""Runs one vLLM engine through a list of phases: ``python -m tests.vllm.engine_run SPEC.json OUT.json``.

Each test scenario is its own process (vLLM keeps process-wide state: the KV connector group,
the distributed environment), started by ``test_vllm_connector.py``. The spec says the mode
(``single``: one process; ``multi``: vLLM's default engine-core and worker processes), the
tensor-parallel size (default 1), the connector's extra config (none: vLLM alone) and the phases;
the results go to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def _llm(spec: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = None
    if spec.get("connector") is not None:
        ktc = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec["connector"],
        )
    kwargs: dict[str, Any] = {}
    if spec["mode"] == "single":
        kwargs["distributed_executor_backend"] = "uni"
    if spec.get("tensor_parallel_size", 1) > 1:
        kwargs["tensor_parallel_size"] = spec["tensor_parallel_size"]
    if spec.get("hybrid_manager") is not None:  # vLLM's hybrid KV cache manager, asked for on or off
        kwargs["disable_hybrid_kv_cache_manager"] = not spec["hybrid_manager"]
    for key in ("max_num_batched_tokens", "skip_tokenizer_init", "enable_prefix_caching"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    if spec.get("kv_events") is not None:  # vLLM's publisher: its own events and the connector's
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    **spec["kv_events"])
    return LLM(
        model=spec["model_dir"],
        dtype=spec.get("dtype", "float32"),
        max_model_len=spec.get("max_model_len", 1024),
        max_num_seqs=spec.get("max_num_seqs", 4),
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 64 << 20),
        disable_log_stats=False,
        kv_transfer_config=ktc,
        **kwargs,
    )


def _channel(llm: Any, rank: int = 0) -> Any:
    from hicache.integrations.vllm import ChannelClient, socket_path

    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    return ChannelClient(socket_path(engine_id, rank))


def _generate(llm: Any, phase: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    logprobs = bool(phase.get("logprobs"))
    sp = SamplingParams(max_tokens=phase.get("max_tokens", 6), temperature=0, logprobs=0 if logprobs else None,
                        detokenize=not logprobs)
    prompts = [{"prompt_token_ids": p} for p in phase["prompts"]]
    if phase.get("burst"):  # all queued at once: vLLM schedules them as its KV allows
        results = llm.generate(prompts, sp, use_tqdm=False)
    else:  # one at a time: each sees what the previous stored
        results = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]
    outs = []
    for out in results:
        outs.append({
            "tokens": list(out.outputs[0].token_ids),
            "cached": out.num_cached_tokens or 0,
            "ttft_s": out.metrics.first_token_latency if out.metrics is not None else None,
        })
        if phase.get("logprobs"):  # each sampled token's logprob: what a Mamba state changes first
            c = out.outputs[0]
            outs[-1]["logprobs"] = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]
    return {"outputs": outs}


def _chain_hashes(index: Any, prompt: list[int]) -> list[int]:
    out, parent, bs = [], None, index.block_size or 1
    for start in range(0, len(prompt) - bs + 1, bs):
        h = index._chain.get((parent, tuple(prompt[start : start + bs])))
        if h is None:
            break
        out.append(h)
        parent = h
    return out


def _routed(llm: Any, phase: dict[str, Any], router: dict[str, Any]) -> dict[str, Any]:
    """Prompts one at a time; before each, the hit a router's index (built from the events vLLM
    published so far) predicts for it, beside the hit vLLM then serves (``num_cached_tokens``)."""
    from vllm import SamplingParams

    from hicache.events.index import PrefixIndex
    from hicache.events.subscriber import EventSubscriber

    if not router:
        index = PrefixIndex()
        router["index"] = index
        router["batches"] = []

        def take(seq: int, events: list[Any]) -> None:
            router["batches"].append([type(e).__name__ + ":" + str(getattr(e, "medium", "")) for e in events])
            router.setdefault("detail", []).append([
                [type(e).__name__, getattr(e, "medium", None), [h % 100000 for h in getattr(e, "block_hashes", [])],
                 (getattr(e, "parent_block_hash", None) or 0) % 100000] for e in events])
            index.apply("w", events)

        router["sub"] = EventSubscriber(phase["endpoint"], replay_endpoint=phase.get("replay_endpoint"),
                                        on_batch=take)
    index, sub = router["index"], router["sub"]
    sp = SamplingParams(max_tokens=phase.get("max_tokens", 4), temperature=0)
    outs = []
    for prompt in phase["prompts"]:
        while sub.poll(0.3):  # until quiet: every batch published so far is in
            pass
        block = index.block_size or phase["block"]
        predicted = min(index.hit(prompt, "w"), (len(prompt) - 1) // block * block)
        media = [sorted(m) for m in index.media(prompt, "w")]
        out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        records = _channel(llm).call({"op": "stats"}).get("requests") or {}
        loaded = next((r for k, r in records.items() if str(k).startswith(str(out.request_id))), None)
        router.setdefault("detail", []).append(["request", [h % 100000 for h in _chain_hashes(index, prompt)]])
        outs.append({"predicted": predicted, "served": out.num_cached_tokens or 0, "media": media,
                     "tokens": list(out.outputs[0].token_ids), "loaded": loaded})
    return {"outputs": outs, "batches": router["batches"][:], "detail": router.get("detail", []), "missed": sub.missed, "replayed": sub.replayed}


def _abort_while_prefetching(llm: Any, phase: dict[str, Any]) -> dict[str, Any]:
    """A long request holds the only slot; the victim is queued (its lookup starts a prefetch from
    a slow storage tier), then aborted while that prefetch is in flight."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    channel = _channel(llm)
    engine.add_request("long", {"prompt_token_ids": phase["long"]}, SamplingParams(max_tokens=8, temperature=0))
    engine.step()
    engine.add_request("victim", {"prompt_token_ids": phase["victim"]}, SamplingParams(max_tokens=4, temperature=0))
    engine.step()
    before = channel.call({"op": "stats"})
    engine.abort_request(["victim"])
    after = channel.call({"op": "stats"})
    while engine.has_unfinished_requests():
        engine.step()
    return {"before": before, "after": after}


def _check_consistent(llm: Any) -> dict[str, Any]:
    """Single-process only: hicache's page accounting once background work has settled."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tests.helpers import assert_consistent

    worker = get_kv_transfer_group().worker
    worker.portal.call(worker.service.settle)  # the steps vLLM ended are finished, background jobs done
    worker.portal.call(lambda: assert_consistent(worker.service.cache))
    return {"consistent": True, "open_steps": worker.service.open_steps}


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    started = time.perf_counter()
    llm = _llm(spec)
    results: list[dict[str, Any]] = []
    router: dict[str, Any] = {}  # the ``routed`` phases' subscriber and index, kept across phases
    for phase in spec["phases"]:
        kind = phase["kind"]
        if kind == "generate":
            results.append(_generate(llm, phase))
        elif kind == "routed":
            results.append(_routed(llm, phase, router))
        elif kind == "reset_prefix_cache":
            results.append({"reset": bool(llm.reset_prefix_cache())})
        elif kind == "stats":  # after the writes queued so far have landed
            channel = _channel(llm)
            channel.call({"op": "wait_idle"})
            results.append(channel.call({"op": "stats"}) or {})
        elif kind == "rank_stats":  # every TP rank's worker, once its queued writes have landed
            ranks = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
            channels = [_channel(llm, rank) for rank in range(ranks)]
            for channel in channels:
                channel.call({"op": "wait_idle"})
            results.append({"ranks": [channel.call({"op": "stats"}) or {} for channel in channels]})
        elif kind == "switch":  # a fault fake's switch file (tests/vllm/fakes.py)
            with open(phase["path"], "w") as f:
                f.write(phase["mode"])
            results.append({})
        elif kind == "abort_while_prefetching":
            results.append(_abort_while_prefetching(llm, phase))
        elif kind == "check_consistent":
            results.append(_check_consistent(llm))
        else:
            raise SystemExit(f"unknown phase {kind!r}")
    with open(sys.argv[2], "w") as f:
        json.dump({"phases": results, "wall_s": time.perf_counter() - started}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
