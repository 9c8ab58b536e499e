"""What a prefill through ``CachedCausalLM`` costs against the model's own forward, by prompt length.

Usage::

    python benchmarks/prefill_overhead.py            # SmolLM2, 128 to 4,096 tokens, 3 rounds: a few minutes
    python benchmarks/prefill_overhead.py --lengths 128,512,1024,2048,4096,8192   # 8,192 adds minutes
    python benchmarks/prefill_overhead.py --help     # --repeats, --cached 0.75, --model, --json, ...

For each length, random token ids, one request, two cases:

* ``cold``: nothing cached. ``own``: the model's forward over the prompt (its own attention, the
  ``DynamicCache`` it makes itself); ``hicache``: ``CachedCausalLM`` over a cache that holds nothing of it.
* ``cached``: the first ``--cached`` of the prompt (page-aligned) is cached. ``own``: the model's
  forward over the rest on top of a ``DynamicCache`` already holding the prefix's KV (put there
  outside the timing, as the oracle configuration of ``hicache bench`` does); ``hicache``: the
  prefix on hicache's device tier, restored into the model's cache as the forward runs.

Both ask for the last position's logits only (``logits_to_keep=1``, what ``CachedCausalLM``
does). ``hicache``'s time is the request's, from ``lookup`` to the first token (``sequence``'s
lease and the prefill, its thread hop and restore included; no store), after one untimed request
of that length (its model cache's buffer is then reused, as between a server's requests). The two
alternate (own, hicache, then hicache, own, ...) ``--repeats`` rounds; the table gives the medians
of both, the median of the rounds' ratios (wall time, and the process's CPU time, which the other
users of a shared machine disturb less), and whether both chose the same first token (and the
largest logit difference). ``/proc/pressure/cpu`` is printed before and after: on a shared
machine read the ratios, which both sides' interleaving keeps fair, rather than the times.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from transformers import DynamicCache  # noqa: E402

from hicache import HiCache, load_config  # noqa: E402
from hicache.bench.models import MODELS, load_model  # noqa: E402
from hicache.bench.profiling import cpu_pressure  # noqa: E402
from hicache.integrations.transformers import CachedCausalLM, ModelSpec, model_overrides  # noqa: E402

PAGE = 16


def cache_config(model: Any, max_prefix: int) -> Any:
    """A device tier holding the longest prefix (and a little more), a host tier as large, no storage."""
    base = model_overrides(model) | {"page_size": PAGE}
    page_bytes = load_config(overrides=base, env={}).page_bytes
    pages = max_prefix // PAGE + 8
    tiers = {"device": {"capacity": pages * page_bytes, "device": "cpu"},
             "host": {"capacity": pages * page_bytes, "pin_memory": False}}
    return load_config(overrides=base | {"tiers": tiers}, env={})


class Case:
    """One length, cold or with a cached prefix: the two ways to prefill it, timed alike."""

    def __init__(self, lm: CachedCausalLM, tokens: list[int], prefix: int) -> None:
        self.lm = lm
        self.tokens = tokens
        self.prefix = prefix
        self.ids = torch.tensor([tokens])
        self.kv: DynamicCache | None = None
        if prefix:
            self.kv = self._own_cache()
            with torch.inference_mode():
                lm.model(input_ids=self.ids[:, :prefix], **{lm._cache_kw: self.kv}, use_cache=True, logits_to_keep=1)

    def _own_cache(self) -> DynamicCache:
        try:
            return DynamicCache(config=self.lm.model.config)
        except TypeError:  # transformers before 4.56
            return DynamicCache()

    def own(self) -> tuple[tuple[float, float], torch.Tensor]:
        """The model's own forward over the uncached part, on its own cache holding the prefix."""
        lm = self.lm
        kv = {lm._cache_kw: self.kv} if self.kv is not None else {}  # cold: the model makes its own cache
        started, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            out = lm.model(input_ids=self.ids[:, self.prefix:], **kv, use_cache=True, logits_to_keep=1)
        took = time.perf_counter() - started, time.process_time() - cpu
        if self.kv is not None:
            self.kv.crop(self.prefix - len(self.tokens))  # back to the prefix alone for the next repeat
        return took, out.logits[0, -1].float()

    async def hicache(self) -> tuple[tuple[float, float], torch.Tensor]:
        """The request through ``CachedCausalLM``: lookup, lease, prefill (restore included)."""
        lm = self.lm
        started, cpu = time.perf_counter(), time.process_time()
        await lm.lookup(self.tokens)
        async with lm.sequence(self.tokens, store=False, max_new_tokens=1) as seq:
            await seq.prefill()
        took = time.perf_counter() - started, time.process_time() - cpu
        if seq.cached_tokens != self.prefix:
            raise RuntimeError(f"expected {self.prefix} cached tokens, the cache served {seq.cached_tokens}")
        assert seq.logits is not None
        return took, seq.logits


async def measure(case: Case, repeats: int, *, warm_own: bool) -> dict[str, Any]:
    """Medians over ``repeats`` rounds, each running both sides back to back (the order alternating),
    and the median of the rounds' ratios: a slow stretch of the machine weighs on both sides of it."""
    if warm_own:
        case.own()  # the first forward of the process (kernels, allocator)
    await case.hicache()  # the model cache's buffer for this length (reused between requests after)
    own_t: list[tuple[float, float]] = []  # (wall, CPU) seconds
    ours_t: list[tuple[float, float]] = []
    own_logits = ours_logits = None
    for r in range(repeats):
        for side in (("own", "hicache") if r % 2 == 0 else ("hicache", "own")):
            if side == "own":
                took, own_logits = case.own()
                own_t.append(took)
            else:
                took, ours_logits = await case.hicache()
                ours_t.append(took)
    assert own_logits is not None and ours_logits is not None
    med = statistics.median
    return {"own_ms": med(w for w, _ in own_t) * 1e3, "hicache_ms": med(w for w, _ in ours_t) * 1e3,
            "ratio": med(o[0] / w[0] for o, w in zip(ours_t, own_t)),
            "own_cpu_ms": med(c for _, c in own_t) * 1e3, "hicache_cpu_ms": med(c for _, c in ours_t) * 1e3,
            "cpu_ratio": med(o[1] / w[1] for o, w in zip(ours_t, own_t)),
            "same_token": int(own_logits.argmax()) == int(ours_logits.argmax()),
            "max_logit_diff": float((own_logits - ours_logits).abs().max())}


def _pressure() -> str:
    p = cpu_pressure()
    return "n/a" if p is None else ", ".join(f"{k} {v:.1f}%" for k, v in p.items())


async def main_async(args: argparse.Namespace) -> int:
    lengths = [int(x) for x in args.lengths.split(",")]
    model = load_model(args.model)
    spec = ModelSpec.of(model)
    vocab = model.config.vocab_size
    prefixes = {n: int(n * args.cached) // PAGE * PAGE for n in lengths}
    print(f"{args.model}: {spec.num_layers} layers, {spec.num_kv_heads} KV heads, head_dim {spec.head_dim}, "
          f"{spec.dtype}; own attention {model.config._attn_implementation!r}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats} rounds, interleaved")
    before = cpu_pressure()
    print(f"CPU pressure before (/proc/pressure/cpu some): {_pressure()}")
    print(f"{'tokens':>6} {'case':<12} {'own ms':>9} {'hicache ms':>10} {'ratio':>6} {'CPU ratio':>9} "
          f"{'same token':>10} {'logit diff':>10}")
    rows: list[dict[str, Any]] = []
    first = True
    gen = torch.Generator().manual_seed(args.seed)
    async with HiCache.from_config(cache_config(model, max(prefixes.values()))) as cache:
        lm = CachedCausalLM(model, cache, segment_attention=args.segment_attention)
        for n in lengths:
            tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
            cold = torch.randint(0, vocab, (n,), generator=gen).tolist()  # a prompt the cache never holds
            cases = [("cold", Case(lm, cold, 0))]
            if prefixes[n]:
                async with lm.sequence(tokens[: prefixes[n]], max_new_tokens=0) as seq:  # stores the prefix
                    await seq.prefill()
                await cache.wait_idle()
                cases.append((f"cached {prefixes[n]}", Case(lm, tokens, prefixes[n])))
            for name, case in cases:
                row = await measure(case, args.repeats, warm_own=first)
                first = False
                rows.append({"tokens": n, "cached_tokens": case.prefix} | row)
                same = "yes" if row["same_token"] else "NO"
                print(f"{n:>6} {name:<12} {row['own_ms']:>9,.1f} {row['hicache_ms']:>10,.1f} {row['ratio']:>6.3f} "
                      f"{row['cpu_ratio']:>9.3f} {same:>10} {row['max_logit_diff']:>10.1e}", flush=True)
    after = cpu_pressure()
    print(f"CPU pressure after: {_pressure()}")
    print(f"worst ratio: wall {max(r['ratio'] for r in rows):.3f}, CPU {max(r['cpu_ratio'] for r in rows):.3f} "
          f"(target <= 1.02)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "repeats": args.repeats, "threads": args.threads,
                                               "cpu_pressure": {"before": before, "after": after}, "rows": rows},
                                              indent=1))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", choices=sorted(MODELS))
    p.add_argument("--lengths", default="128,512,1024,2048,4096", help="prompt lengths, tokens (8192 takes minutes)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per side, after one warm-up")
    p.add_argument("--cached", type=float, default=0.75, help="share of the prompt cached in the second case")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--segment-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="CachedCausalLM's segment attention (default: where it runs, the CPU)")
    p.add_argument("--json", help="also write the rows and the CPU pressure to this file")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    return anyio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
