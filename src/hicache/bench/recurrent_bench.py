"""``hicache bench recurrent``: what checkpoints of a recurrent hybrid cost and what they save.

A document is stored once through ``CachedCausalLM`` (a file tier below), then another cache over
the same folder, warmed by one question (which reads the document back), serves two kinds of
prompts, each timed to its first token (prompts store nothing, so each finds what the first read):

* *continuations*: the document and a question (the hit ends on the document's last checkpoint);
* *branches*: a prompt that shares the document up to a point inside it, then goes on elsewhere
  (the hit ends on the last checkpoint before the branch: the interval decides how much is
  recomputed).

Each is measured against an *oracle* given the state and the KV at the exact branch point for free
(only the prompt's own new tokens are computed, with the same model in the same process) and
against no cache. For every checkpoint interval the report prints the bytes the file tier holds
(per cached token, and the checkpoints' share, beside the model's own state size) against the
tokens a branch recomputes, so the interval's cost and benefit read side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

__all__ = ["add_parser", "run_recurrent_benchmark"]

PAGE = 16


def add_parser(sub: Any) -> None:
    from .models import MODELS

    p = sub.add_parser("recurrent", help="a recurrent hybrid's checkpoints: bytes per interval against tokens recomputed")
    g = p.add_argument_group("workload")
    g.add_argument("--model", choices=sorted(n for n in MODELS if "lfm2" in n or "qwen3-next" in n or "granite4" in n),
                   default="random-lfm2", help="a recurrent preset (default: random-lfm2)")
    g.add_argument("--document-length", type=int, default=1024)
    g.add_argument("--question-length", type=int, default=64)
    g.add_argument("--branches", type=int, default=6, help="prompts branching off inside the document")
    g.add_argument("--continuations", type=int, default=3, help="questions after the whole document")
    g.add_argument("--intervals", default="0,64,256", help="checkpoint_interval_tokens to compare (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--out", default=None, help="folder for results.json and the file tiers (default: a temporary one)")


def run_recurrent_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="hicache-recurrent-"))
    out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(_run(args, out))
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(_report(results))
    print(f"\nwrote {out / 'results.json'}")
    return results


async def _run(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from .models import MODELS, load_model

    model = load_model(args.model, seed=args.seed)
    rng = random.Random(args.seed)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    doc = [rng.randrange(100, vocab) for _ in range(args.document_length)]
    tails = [[rng.randrange(100, vocab) for _ in range(args.question_length)]
             for _ in range(args.branches + args.continuations)]
    cuts = sorted(rng.randrange(args.question_length, args.document_length) for _ in range(args.branches))
    prompts = [("branch", doc[:c] + t) for c, t in zip(cuts, tails)]
    prompts += [("continuation", doc + t) for t in tails[args.branches :]]
    oracle = [_oracle_ttft(model, p, len(p) - args.question_length) for _, p in prompts]
    no_cache = [_oracle_ttft(model, p, 0) for _, p in prompts]
    runs = []
    shared = [len(p) - args.question_length for _, p in prompts]
    for every in [int(x) for x in args.intervals.split(",")]:
        runs.append(await _interval_run(model, doc, prompts, shared, every, out / f"pages-{every}"))
    return {
        "model": args.model, "description": MODELS[args.model].description,
        "document_length": args.document_length, "question_length": args.question_length,
        "prompts": [{"kind": k, "length": len(p), "shared": len(p) - args.question_length} for k, p in prompts],
        "oracle_ttft_s": oracle, "no_cache_ttft_s": no_cache, "intervals": runs,
        **_state_sizes(model),
    }


def _state_sizes(model: Any) -> dict[str, int]:
    from ..integrations.transformers import ModelSpec

    spec = ModelSpec.of(model)
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    return {
        "state_bytes": sum(k.state_bytes for k in spec.layers),  # one checkpoint of every recurrent layer
        "kv_bytes_per_token": 2 * len(spec.layers.full) * spec.num_kv_heads * spec.head_dim * itemsize,
    }


def _oracle_ttft(model: Any, prompt: list[int], given: int) -> float:
    """Seconds to the first token with the state and KV of ``prompt[:given]`` given for free."""
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        if given:
            model(input_ids=torch.tensor([prompt[:given]]), past_key_values=cache, use_cache=True)
        started = time.perf_counter()
        logits = model(input_ids=torch.tensor([prompt[given:]]), past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits
        int(logits[0, -1].argmax())
        return time.perf_counter() - started


async def _interval_run(model: Any, doc: list[int], prompts: list[tuple[str, list[int]]], shared: list[int],
                        every: int, pages: Path) -> dict[str, Any]:
    from .. import HiCache, load_config
    from ..integrations.transformers import CachedCausalLM, model_overrides

    shutil.rmtree(pages, ignore_errors=True)  # a folder of an earlier run would make the store write nothing

    config = load_config(overrides=model_overrides(model) | {
        "page_size": PAGE,
        "tiers": {"device": {"capacity": "1GiB", "device": "cpu"}, "host": {"capacity": "1GiB", "pin_memory": False},
                  "storage": [{"kind": "file", "path": str(pages), "fsync": "never"}]},
        "policies": {"prefetch": "wait_complete", "prefetch_threshold_tokens": 16, "checkpoint_interval_tokens": every},
    }, env={})
    async with HiCache.from_config(config) as cache:
        lm = CachedCausalLM(model, cache)
        started = time.perf_counter()
        async with lm.sequence(doc + [7]) as seq:
            await seq.prefill()
        store_s = time.perf_counter() - started
        await cache.wait_idle()
        stats = cache.stats().storage["file"].backend
        written, objects = stats.bytes_written, stats.pages_written
    full_pages = len(doc) // PAGE
    checkpoints = objects - full_pages
    rows = []
    async with HiCache.from_config(config) as cache:  # another cache: the document comes from the file tier
        lm = CachedCausalLM(model, cache)
        for i, ((kind, prompt), common) in enumerate([(prompts[-1], shared[-1]), *zip(prompts, shared)]):
            started = time.perf_counter()
            await lm.lookup(prompt)
            async with lm.sequence(prompt, store=False) as seq:
                await seq.prefill()
                ttft = time.perf_counter() - started
            if i:  # the first, a warm-up, reads the document back from the file tier; not counted
                rows.append({"kind": kind, "ttft_s": ttft, "cached": seq.cached_tokens,
                             "recomputed": max(0, common - seq.cached_tokens),
                             "from_file": seq.by_tier.get("file", 0)})
    return {"interval_tokens": every, "store_s": store_s, "stored_bytes": written, "stored_objects": objects,
            "checkpoints": checkpoints, "full_pages": full_pages, "cached_tokens": full_pages * PAGE, "requests": rows}


def _report(r: dict[str, Any]) -> str:
    lines = [f"hicache bench recurrent: model {r['model']} ({r['description']})",
             f"  a {r['document_length']}-token document stored once; prompts add {r['question_length']} tokens, "
             "served by another cache that read the document back from the file tier",
             f"  the model's state: {r['state_bytes']:,} bytes a checkpoint (every recurrent layer); "
             f"its attention KV: {r['kv_bytes_per_token']:,} bytes a token", ""]
    oracle, none = r["oracle_ttft_s"], r["no_cache_ttft_s"]
    kinds = [p["kind"] for p in r["prompts"]]
    head = ("interval  checkpoints  stored bytes/cached token  checkpoint bytes (stored)  tokens recomputed/branch  "
            "TTFT branch / oracle  TTFT continuation / oracle  no-cache / hicache")
    lines += [head, "-" * len(head)]
    for run in r["intervals"]:
        reqs = run["requests"]
        per_token = run["stored_bytes"] / max(1, run["cached_tokens"])
        ckpt = (run["stored_bytes"] - run["full_pages"] * _full_part_bytes(r)) / max(1, run["checkpoints"])
        branch = [q for q, k in zip(reqs, kinds) if k == "branch"]
        cont = [q for q, k in zip(reqs, kinds) if k == "continuation"]
        ratio = lambda qs, idx: statistics.mean(q["ttft_s"] for q in qs) / statistics.mean(oracle[i] for i in idx)  # noqa: E731
        b_idx = [i for i, k in enumerate(kinds) if k == "branch"]
        c_idx = [i for i, k in enumerate(kinds) if k == "continuation"]
        speedup = statistics.mean(none) / statistics.mean(q["ttft_s"] for q in reqs)
        lines.append(
            f"{run['interval_tokens']:>8}  {run['checkpoints']:>11}  {per_token:>25,.0f}  {ckpt:>25,.0f}  "
            f"{statistics.mean(q['recomputed'] for q in branch) if branch else 0:>24.0f}  "
            f"{ratio(branch, b_idx) if branch else float('nan'):>20.2f}  "
            f"{ratio(cont, c_idx) if cont else float('nan'):>26.2f}  {speedup:>17.2f}"
        )
    lines.append("")
    lines.append("  oracle: the state and KV at the branch point given for free (only the new tokens computed)")
    return "\n".join(lines)


def _full_part_bytes(r: dict[str, Any]) -> int:
    """Bytes of one page's full part (its attention layers) as stored: KV and header."""
    from ..tiers.storage.page_format import HEADER_BYTES

    return PAGE * r["kv_bytes_per_token"] + HEADER_BYTES
