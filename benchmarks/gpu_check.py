"""``make gpu-check``: the CUDA path in one go, in under five minutes.

1. ``pytest -m gpu``: the tests that need CUDA (round trips through a CUDA device pool and pinned
   host pool with both io backends; a prefix restored on the GPU gives the logits of a full
   prefill).
2. Transfers through ``TransferEngine`` between a CUDA device pool and a pinned host pool, against
   a raw ``copy_`` of the same bytes between a pinned host buffer and a device buffer (one
   contiguous copy each way, the cudaMemcpy-class limit), timed back to back in the same run:

   * ``load``: ``host_to_device(layerwise=True)`` (the load stream, one event per layer) against
     a raw host -> device ``copy_``;
   * ``backup``: ``device_to_host`` (the write stream) against a raw device -> host ``copy_``.

   ``ratio`` = median over repeats of raw time / op time; the target is >= 0.9.

Without CUDA it prints why and exits 0: there is nothing to check on this machine.

    python benchmarks/gpu_check.py [--pages 64] [--repeat 10] [--skip-tests] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
try:
    import hicache  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT / "src"))

from hicache.io import KernelIOBackend, TransferEngine  # noqa: E402
from hicache.tiers import DevicePool, HostPool, KVGeometry  # noqa: E402

TARGET = 0.9
TEST_TIMEOUT_S = 180  # the whole check stays under five minutes


def run_tests() -> tuple[bool, str]:
    """``pytest -m gpu`` in a child process; (passed, its summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TEST_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return False, f"pytest -m gpu did not finish within {TEST_TIMEOUT_S} s"
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr.strip()[-500:]
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return proc.returncode == 0, summary


def _median_ratio(op, raw, repeat: int) -> tuple[float, float, float]:  # noqa: ANN001 - two callables
    """(median raw/op ratio, median op seconds, median raw seconds), op and raw timed back to back."""
    op()
    raw()  # warm-up (CUDA context, caching allocator, streams)
    ops: list[float] = []
    raws: list[float] = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        raw()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        op()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        raws.append(t1 - t0)
        ops.append(t2 - t1)
    return statistics.median(r / o for r, o in zip(raws, ops)), statistics.median(ops), statistics.median(raws)


def transfers(pages: int, repeat: int, layers: int, heads: int, head_dim: int, page_size: int) -> list[dict]:
    g = KVGeometry(2, layers, page_size, heads, head_dim, torch.float32)
    capacity = 2 * pages * g.page_bytes
    device_pool = DevicePool(g, capacity, device="cuda")
    host_pool = HostPool(g, capacity, layout="layer_first", pin_memory=True)
    anyio.run(device_pool.open)
    anyio.run(host_pool.open)
    device_pool.buffer.normal_()
    host_pool.buffer.normal_()
    engine = TransferEngine(KernelIOBackend(), device_pool, host_pool)
    src = list(range(pages))
    dst = list(range(pages, 2 * pages))
    nbytes = pages * g.page_bytes
    raw_host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=True)
    raw_dev = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")

    def load() -> None:
        engine.host_to_device(src, dst, lambda _layer: None, True)

    def backup() -> None:
        engine.device_to_host(src, dst)

    def raw_h2d() -> None:
        raw_dev.copy_(raw_host, non_blocking=True)

    def raw_d2h() -> None:
        raw_host.copy_(raw_dev, non_blocking=True)

    # Correctness first: what the engine moved is what the source held.
    load()
    torch.cuda.synchronize()
    ok_load = torch.equal(device_pool.page_major()[dst].cpu(), host_pool.page_major()[src])
    backup()
    ok_backup = torch.equal(host_pool.page_major()[dst], device_pool.page_major()[src].cpu())
    rows = []
    for name, op, raw, ok in (("load (host->device, layer-wise)", load, raw_h2d, ok_load),
                              ("backup (device->host)", backup, raw_d2h, ok_backup)):
        ratio, op_s, raw_s = _median_ratio(op, raw, repeat)
        rows.append({"direction": name, "bytes": nbytes, "op_gbps": nbytes / op_s / 1e9,
                     "raw_gbps": nbytes / raw_s / 1e9, "ratio": ratio, "ok": ok})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64, help="pages per transfer (default 64: 192 MiB)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--skip-tests", action="store_true", help="only the transfer benchmark")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu-check: CUDA is not available here (torch {torch.__version__}, "
              f"built with CUDA {torch.version.cuda or 'none'}): nothing to check; run it on a machine with a GPU.")
        return 0
    started = time.perf_counter()
    print(f"gpu-check on {torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})")
    tests_ok, summary = (True, "skipped") if args.skip_tests else run_tests()
    print(f"pytest -m gpu: {summary}")
    rows = transfers(args.pages, args.repeat, args.layers, args.heads, args.head_dim, args.page_size)
    print(f"\n{'direction':34} {'MiB':>6} {'hicache GB/s':>13} {'raw copy_ GB/s':>15} {'ratio':>6}  ok")
    for r in rows:
        print(f"{r['direction']:34} {r['bytes'] / 2**20:6.0f} {r['op_gbps']:13.2f} {r['raw_gbps']:15.2f} "
              f"{r['ratio']:6.3f}  {'yes' if r['ok'] else 'NO'}")
    met = all(r["ratio"] >= TARGET for r in rows)
    print(f"\ntarget ratio >= {TARGET}: {'met' if met else 'MISSED'}; {time.perf_counter() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps({"tests_ok": tests_ok, "tests": summary, "rows": rows}, indent=1))
    return 0 if tests_ok and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
