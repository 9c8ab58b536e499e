"""What attending over a restored prefix costs, per layer: in the device pages or copied in.

Usage::

    python benchmarks/prefix_attention.py [--heads 9] [--kv-heads 3] [--head-dim 64] [--page 16]

One layer of one step (a prefill chunk of ``--queries`` tokens, and a decode step of one token)
over a prefix of ``P`` tokens that the cache holds in ``R`` runs of consecutive device pages
(the pool is ``[2, L, pages, page, H, D]``, token-major). Three ways, timed back to back:

* ``limit``: the prefix already in the model's buffer, contiguous: one flash call (what the
  ``oracle`` configuration gets, since it puts the prefix in place outside the timing);
* ``copy in``: the runs copied into the buffer (once per prefill; free for the decode steps,
  which then attend as ``limit``), then the same one flash call: hicache's default;
* ``in pages``: no copy; a flash call per run over views of the pages, merged by log-sum-exp
  (``attend_in_pages=True``), in the prefill and again in every decode step.

Printed: microseconds (best of 5 rounds) and each as a ratio to ``limit`` in the same run. The
defaults are SmolLM2-135M's geometry (fp32), the benchmark's model.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from hicache.integrations.transformers.attention import Segments, segment_attention  # noqa: E402


def best_us(fn: Callable[[], object], calls: int, rounds: int = 5) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def one_case(args: argparse.Namespace, prefix: int, queries: int, runs: int) -> tuple[float, float, float, float]:
    """(limit, copy, copy in + limit, in pages) in microseconds for one layer of one step."""
    kv, dim, page = args.kv_heads, args.head_dim, args.page
    pages = prefix // page
    pool = torch.randn(2, 1, pages + runs, page, kv, dim)  # one layer of a token-major device pool
    per = pages // runs
    views = []
    for r in range(runs):  # runs one page apart, as a pool with other sequences' pages between
        first = r * (per + 1)
        n = per if r < runs - 1 else pages - per * (runs - 1)
        k, v = (pool[c, 0, first:first + n].reshape(n * page, kv, dim).transpose(0, 1).unsqueeze(0) for c in (0, 1))
        views.append((k, v))
    own = queries if queries > 1 else 16  # a decode step's own tokens: the prompt's new part and the output so far
    total = sum(k.shape[-2] for k, _ in views) + own
    buf_k, buf_v = torch.randn(1, kv, total, dim), torch.randn(1, kv, total, dim)
    q = torch.randn(1, args.heads, queries, dim)
    whole = Segments((), buf_k, buf_v, queries)
    in_pages = Segments(tuple(views), buf_k[:, :, -own:], buf_v[:, :, -own:], queries)

    def copy_in() -> None:
        at = 0
        for k, v in views:
            n = k.shape[-2]
            buf_k[:, :, at:at + n].copy_(k)
            buf_v[:, :, at:at + n].copy_(v)
            at += n

    calls = args.calls if queries == 1 else max(1, args.calls // 10)
    limit = best_us(lambda: segment_attention(None, q, whole, whole, None), calls)
    copy = best_us(copy_in, calls)
    pages_us = best_us(lambda: segment_attention(None, q, in_pages, in_pages, None), calls)
    return limit, copy, limit + copy, pages_us


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--queries", type=int, default=128, help="tokens of a prefill chunk")
    p.add_argument("--prefixes", default="256,592,1184", help="prefix lengths, tokens")
    p.add_argument("--runs", default="1,2,4", help="runs of consecutive pages the prefix lies in")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"one layer: {args.heads} query heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, fp32, "
          f"page {args.page}; torch {torch.__version__}, {args.threads} threads; us, best of 5")
    print(f"{'step':<8} {'prefix':>6} {'runs':>4} {'limit':>8} {'copy':>7} {'copy in':>8} {'/limit':>7} "
          f"{'in pages':>9} {'/limit':>7}")
    for queries, step in ((args.queries, "prefill"), (1, "decode")):
        for prefix in (int(x) for x in args.prefixes.split(",")):
            for runs in (int(x) for x in args.runs.split(",")):
                limit, copy, copied, pages_us = one_case(args, prefix, queries, runs)
                if queries == 1:
                    copy, copied = 0.0, limit  # the copy was paid once, in the prefill
                print(f"{step:<8} {prefix:>6} {runs:>4} {limit:>8,.0f} {copy:>7,.0f} {copied:>8,.0f} "
                      f"{copied / limit:>7.2f} {pages_us:>9,.0f} {pages_us / limit:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
