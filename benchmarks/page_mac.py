"""What authenticating a page costs: MAC candidates on KV-sized pages, in GB/s and microseconds per page.

Usage::

    python benchmarks/page_mac.py [--page-mib 3] [--pages 64] [--repeat 5] [--pieces 1] [--json out.json]

Times, on ``--pages`` pages of ``--page-mib`` MiB of random bytes (fed in ``--pieces`` pieces each, as a
``layer_first`` host pool hands them: one piece per component and layer), each candidate for the check
that runs on every page read from (and written to) a storage tier:

* ``xxh3_64``: the unkeyed checksum used without a ``tenant_key`` (integrity only, not a MAC);
* ``blake2b keyed``: ``hashlib.blake2b(key=...)`` from the standard library;
* ``aes-256-gmac``: what a tier with a ``tenant_key`` computes (``PageCodec``'s check value: AES-GCM
  with the page as associated data, OpenSSL through ``cryptography``);
* ``blake3 keyed``: the ``blake3`` package in keyed mode, one thread (``max_threads=1``), the keyed
  check of earlier versions (page format 2);
* ``blake3 keyed, N threads``: the same with ``max_threads=blake3.AUTO`` (Rayon's pool).

Each candidate also runs in two Python threads at once (one page stream each) to show whether it
releases the GIL: the tier verifies one batch while the next is read, so a MAC that holds the GIL
would serialise with the I/O. The denominator is a plain ``memcpy`` of the same bytes
(``numpy.copyto``), measured in the same run: a MAC at ``x`` GB/s costs ``1/x`` seconds per GB on
top of the transfer. GB = 1e9 B. Record /proc/pressure/cpu with the numbers.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import xxhash  # noqa: E402

KEY = bytes(range(32))


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return "(unreadable)"


def candidates() -> dict[str, Callable[[Sequence[memoryview]], bytes]]:
    def xxh3(pieces: Sequence[memoryview]) -> bytes:
        h = xxhash.xxh3_64()
        for p in pieces:
            h.update(p)
        return h.digest()

    def blake2b(pieces: Sequence[memoryview]) -> bytes:
        h = hashlib.blake2b(key=KEY, digest_size=32)
        for p in pieces:
            h.update(p)
        return h.digest()

    out: dict[str, Callable[[Sequence[memoryview]], bytes]] = {"xxh3_64 (no key)": xxh3, "blake2b keyed": blake2b}
    out["aes-256-gmac (the tier's keyed check)"] = _page_gmac()
    try:
        import blake3
    except ImportError:
        print("blake3 is not installed (pip install blake3): its rows are missing", file=sys.stderr)
        return out

    def blake3_one(pieces: Sequence[memoryview]) -> bytes:
        h = blake3.blake3(key=KEY, max_threads=1)
        for p in pieces:
            h.update(p)
        return h.digest()

    def blake3_auto(pieces: Sequence[memoryview]) -> bytes:
        h = blake3.blake3(key=KEY, max_threads=blake3.blake3.AUTO)
        for p in pieces:
            h.update(p)
        return h.digest()

    out["blake3 keyed, 1 thread"] = blake3_one
    out[f"blake3 keyed, AUTO threads ({os.cpu_count()} cpus)"] = blake3_auto
    return out


def _page_gmac() -> Callable[[Sequence[memoryview]], bytes]:
    """What a keyed tier computes per page: ``PageCodec``'s own check value (nonce + GMAC tag)."""
    try:
        import hicache  # noqa: F401
    except ImportError:  # running from a checkout without `pip install -e .`
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
    import torch

    from hicache.keys import TenantKey
    from hicache.tiers.base import KVGeometry
    from hicache.tiers.storage.page_format import PageCodec

    codec = PageCodec(b"\x01" * 16, KVGeometry(2, 1, 1, 1, 1, torch.float32), TenantKey(KEY.hex()))
    fields = bytes(88)
    return lambda pieces: codec._check_value(fields, pieces)


def time_pages(fn: Callable[[Sequence[memoryview]], object], pages: list[list[memoryview]]) -> float:
    t0 = time.perf_counter()
    for pieces in pages:
        fn(pieces)
    return time.perf_counter() - t0


def time_two_threads(fn: Callable[[Sequence[memoryview]], object], pages: list[list[memoryview]]) -> float:
    """Both threads hash every page; wall seconds for the two streams together."""
    start = threading.Barrier(3)

    def stream() -> None:
        start.wait()
        for pieces in pages:
            fn(pieces)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page-mib", type=float, default=3.0, help="page size in MiB (default 3)")
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--pieces", type=int, default=1, help="pieces per page (60 = layer_first, 30 layers x K/V)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    page_bytes = int(args.page_mib * 2**20) // args.pieces * args.pieces
    pressure_start = cpu_pressure()
    print(f"cpu pressure at start: {pressure_start}")
    data = np.random.default_rng(0).integers(0, 256, (args.pages, page_bytes), dtype=np.uint8)
    pages = [[memoryview(piece) for piece in np.split(row, args.pieces)] for row in data]
    total = args.pages * page_bytes
    dst = np.empty_like(data)

    rows: dict[str, dict[str, float]] = {}
    copy_s = []
    results: dict[str, list[float]] = {}
    both: dict[str, list[float]] = {}
    fns = candidates()
    for _ in range(args.repeat):  # interleaved, so noise hits every candidate alike
        t0 = time.perf_counter()
        np.copyto(dst, data)
        copy_s.append(time.perf_counter() - t0)
        for name, fn in fns.items():
            results.setdefault(name, []).append(time_pages(fn, pages))
            both.setdefault(name, []).append(time_two_threads(fn, pages))
    copy_gbps = total / statistics.median(copy_s) / 1e9
    print(
        f"\n{args.pages} pages x {page_bytes / 2**20:.2f} MiB in {args.pieces} piece(s), median of {args.repeat}; "
        f"memcpy of the same bytes: {copy_gbps:.2f} GB/s"
    )
    header = f"{'candidate':<40} {'GB/s':>7} {'us/page':>9} {'ms/GB':>7} {'x memcpy':>8} {'2 threads GB/s':>15}"
    print(header)
    for name in fns:
        secs = statistics.median(results[name])
        gbps = total / secs / 1e9
        two = 2 * total / statistics.median(both[name]) / 1e9
        rows[name] = {
            "gbps": gbps, "us_per_page": secs / args.pages * 1e6, "ms_per_gb": 1e3 / gbps,
            "ratio_to_memcpy": gbps / copy_gbps, "two_threads_gbps": two,
        }
        r = rows[name]
        print(
            f"{name:<40} {gbps:>7.2f} {r['us_per_page']:>9.0f} {r['ms_per_gb']:>7.1f} "
            f"{r['ratio_to_memcpy']:>8.3f} {two:>15.2f}"
        )
    pressure_end = cpu_pressure()
    print(f"\ncpu pressure at end: {pressure_end}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "page_bytes": page_bytes, "pages": args.pages, "pieces": args.pieces, "repeat": args.repeat,
                    "memcpy_gbps": copy_gbps, "rows": rows,
                    "cpu_pressure_start": pressure_start, "cpu_pressure_end": pressure_end,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
