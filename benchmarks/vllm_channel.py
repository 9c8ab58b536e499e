"""The vLLM connector's side channel: one scheduler lookup's round trip, against a raw socket echo.

    python benchmarks/vllm_channel.py [--tokens 1024] [--n 2000]

The scheduler asks the worker's cache how many tokens of a prompt it holds over a Unix socket
(``hicache.integrations.vllm.channel``). This measures that call (JSON framing, the cache's
``lookup`` of a cached prompt, the reply) and, as the denominator, a raw echo of the same request
bytes over a Unix socket pair in the same run. Also: the weights fingerprint of SmolLM2's folder.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from anyio.from_thread import start_blocking_portal

from hicache import load_config
from hicache.integrations.vllm.channel import ChannelClient, encode, pack_tokens
from hicache.integrations.vllm.service import CacheService


def _echo_server(sock: socket.socket) -> None:
    while True:
        data = sock.recv(1 << 20)
        if not data:
            return
        sock.sendall(data)


def raw_round_trip(payload: bytes, n: int) -> list[float]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    threading.Thread(target=_echo_server, args=(b,), daemon=True).start()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        a.sendall(payload)
        got = 0
        while got < len(payload):
            got += len(a.recv(1 << 20))
        out.append(time.perf_counter() - t)
    a.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--n", type=int, default=2000)
    args = p.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(1)
    config = load_config(overrides={
        "model": {"name": "bench", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "page_size": 128, "tiers": {"device": {"capacity": "8MiB", "device": "cpu"}, "host": {"capacity": "8MiB"}},
    }, env={})
    tokens = list(range(100, 100 + args.tokens))
    kv = torch.zeros((2, 2, args.tokens, 2, 8))
    message = {"op": "lookup", "req": "r", "tokens": tokens, "prefetch": False}
    timings: dict[str, list[float]] = {"packed": [], "list": []}
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "bench.sock")
        with start_blocking_portal() as portal, portal.wrap_async_context_manager(CacheService(config, path)) as svc:
            portal.call(svc.cache.store, tokens, kv)
            client = ChannelClient(path)
            assert client.call(message)["tokens"] == args.tokens
            for _ in range(args.n):
                for form, out in timings.items():
                    t = time.perf_counter()
                    # what the scheduler sends (packing included), or the token ids as a JSON list
                    ids = pack_tokens(tokens) if form == "packed" else tokens
                    client.call({"op": "lookup", "req": "r", "tokens": ids, "prefetch": False})
                    out.append(time.perf_counter() - t)
            client.close()
    packed = {**message, "tokens": pack_tokens(tokens)}
    raw = raw_round_trip(encode(packed), args.n)
    lk, ls, rw = (statistics.median(x) * 1e6 for x in (timings["packed"], timings["list"], raw))
    print(f"lookup of a cached {args.tokens}-token prompt over the channel (ids packed, as the scheduler sends "
          f"them): median {lk:.0f} us (p90 {statistics.quantiles(timings['packed'], n=10)[-1] * 1e6:.0f} us); "
          f"ids as a JSON list: {ls:.0f} us")
    print(f"raw Unix-socket echo of the same {len(encode(packed)):,} bytes: median {rw:.0f} us")
    print(f"ratio lookup / raw echo: {lk / rw:.1f}x")
    try:
        from hicache.bench.models import smollm2_dir
        from hicache.integrations.vllm.settings import weights_fingerprint

        folder = smollm2_dir()
        size = sum(f.stat().st_size for f in folder.iterdir() if f.suffix == ".safetensors")
        t = time.perf_counter()
        weights_fingerprint(folder)
        dt = time.perf_counter() - t
        print(f"weights fingerprint of SmolLM2 ({size / 1e6:.0f} MB, page cache warm after the first read): "
              f"{dt:.2f} s ({size / dt / 1e9:.1f} GB/s)")
    except Exception as exc:  # the model is optional here
        print(f"(SmolLM2 fingerprint skipped: {exc!r})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
