"""The vLLM connector's per-layer copies between vLLM's blocks and hicache's host pages.

    python benchmarks/vllm_copies.py [--pages 1,5] [--layers 30] [--heads 3] [--head-dim 64] [--n 300]

Inside vLLM's forward, before and after each layer's attention, the connector copies that layer of
a request's pages between vLLM's CPU layout ``[blocks, H, 2 * block_size, D]`` and the host tier's
pages ``[C, page_size, H, D]`` (``integrations/vllm/layout.py``). This times one such call, for a
run of N pages, three ways:

* ``numpy``: what the connector does: ``copy_in`` / ``copy_out`` on views made once (integer words,
  one ``np.copyto`` per run, on the calling thread);
* ``torch``: the same strided copy as one torch ``copy_`` of permuted views made per call (the
  connector's path before), with torch's thread count at 1 and at 2 (vLLM's OpenMP threads: with
  ``OMP_WAIT_POLICY=PASSIVE`` a copy over torch's grain wakes a sleeping thread each time);
* ``raw``: a ``copy_`` of the same bytes between preallocated buffers, contiguous per page and
  layer (the same walk), the denominator.

"hot" repeats the same pages of one layer; "cold" walks every layer and a pool of pages larger than
the caches, as the forward does. Defaults: SmolLM2-135M's KV geometry (30 layers, 3 KV heads, head
dim 64, fp32, block 128). Prints GB/s, the ratio to ``raw`` and the machine's CPU pressure.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from hicache.integrations.vllm.layout import BlockLayout, CopyRun  # noqa: E402


def _pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().splitlines()[0]
    except OSError:
        return "n/a"


def _time(fn: Callable[[], None], n: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n


def _torch_copy(layout: BlockLayout, kv: torch.Tensor, tier_layer: torch.Tensor, run: CopyRun, out: bool) -> None:
    """The strided torch copy of one run (the connector's previous path: views made per call)."""
    nb, ps, h, d = kv.shape[0], layout.page_size, layout.num_kv_heads, layout.head_dim
    blocks = kv.view(nb, h, 2, 1, ps, d)[run.block : run.block + run.length, :, :, 0]  # [n, H, C, ps, D]
    pages = tier_layer.unflatten(2, (ps, h, d))[run.page : run.page + run.length]  # [n, C, ps, H, D]
    if out:
        pages.copy_(blocks.permute(0, 2, 3, 1, 4))
    else:
        blocks.copy_(pages.permute(0, 3, 1, 2, 4))


class _Walk:
    """Where each call copies: the same pages of one layer ("hot"), or every layer and a pool of
    pages in turn ("cold", as the forward walks the layers)."""

    def __init__(self, case: str, pages: int, layers: int, pool: int) -> None:
        self.case, self.n, self.layers, self.pool, self.i = case, pages, layers, pool, 0

    def next(self) -> tuple[int, CopyRun]:
        n, pool = self.n, self.pool
        if self.case == "hot":
            return 3, CopyRun(block=1, sub=0, page=2, length=n)
        self.i += 1
        layer, at = self.i % self.layers, (self.i // self.layers * n) % (pool - n)
        return layer, CopyRun(block=(at + pool // 2) % (pool - n), sub=0, page=at, length=n)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pages", default="1,5", help="pages per run, comma-separated")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--pool-pages", type=int, default=64, help="host pages (and vLLM blocks) the cold walk covers")
    p.add_argument("--n", type=int, default=300, help="calls per figure")
    args = p.parse_args()

    L, H, D, bs, P = args.layers, args.heads, args.head_dim, args.block_size, args.pool_pages
    layout = BlockLayout(block_size=bs, page_size=bs, num_kv_heads=H, head_dim=D)
    kv = [torch.randn(P, H, bs, 2 * D) for _ in range(L)]  # vLLM's layers
    host = torch.randn(P, 2, L, bs * H * D)  # the host tier, page-first
    tier_layers = [host[:, :, i] for i in range(L)]
    blocks = [layout.blocks_view(k) for k in kv]
    pages = [layout.pages_view(t) for t in tier_layers]
    far = (torch.randn(P, L, 2 * bs * H * D), torch.randn(P, L, 2 * bs * H * D))  # raw: contiguous page layers, touched
    page_layer_bytes = 2 * bs * H * D * 4
    print(f"geometry: {L} layers, {H} KV heads, head dim {D}, fp32, block {bs}: "
          f"{page_layer_bytes / 1e3:.0f} kB per page and layer; pool {P} pages ({host.nbytes / 1e6:.0f} MB)")
    print(f"CPU pressure before: {_pressure()}")
    print(f"{'pages':>5} {'case':>5} {'dir':>4} {'path':>10} {'us/call':>8} {'GB/s':>6} {'/ raw':>6}")
    for n in (int(x) for x in args.pages.split(",")):
        nbytes = n * page_layer_bytes
        torch.set_num_threads(1)
        for case in ("hot", "cold"):
            raw_s = _time(functools.partial(_raw_call, _Walk(case, n, L, P), far, n), args.n)
            print(f"{n:>5} {case:>5} {'':>4} {'raw copy_':>10} {raw_s * 1e6:8.1f} {nbytes / raw_s / 1e9:6.2f}")
            for direction in ("in", "out"):
                for path, threads in (("numpy", 1), ("torch 1t", 1), ("torch 2t", 2)):
                    walk = _Walk(case, n, L, P)
                    if path == "numpy":
                        fn = functools.partial(_numpy_call, layout, walk, pages, blocks, direction == "out")
                    else:
                        fn = functools.partial(_torch_call, layout, walk, kv, tier_layers, direction == "out")
                    torch.set_num_threads(threads)
                    s = _time(fn, args.n)
                    print(f"{n:>5} {case:>5} {direction:>4} {path:>10} {s * 1e6:8.1f} {nbytes / s / 1e9:6.2f} "
                          f"{raw_s / s:6.2f}")
    print(f"CPU pressure after: {_pressure()}")
    return 0


def _raw_call(walk: _Walk, far: tuple[torch.Tensor, torch.Tensor], n: int) -> None:
    """The same bytes between two buffers that hold each page's layer contiguously."""
    layer, run = walk.next()
    far[1][run.block : run.block + n, layer].copy_(far[0][run.page : run.page + n, layer])


def _numpy_call(layout: BlockLayout, walk: _Walk, pages: list, blocks: list, out: bool) -> None:
    layer, run = walk.next()
    if out:
        layout.copy_out(blocks[layer], pages[layer], [run])
    else:
        layout.copy_in(pages[layer], blocks[layer], [run])


def _torch_call(layout: BlockLayout, walk: _Walk, kv: list, tier_layers: list, out: bool) -> None:
    layer, run = walk.next()
    _torch_copy(layout, kv[layer], tier_layers[layer], run, out)


if __name__ == "__main__":
    raise SystemExit(main())
