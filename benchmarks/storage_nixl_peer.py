"""``kind: nixl-peer``: a consumer process pulling a producer process's pages over UCX, against the raw
UCX READ of the same bytes from the same memory, in the same run.

Usage (``python benchmarks/storage.py --backend nixl-peer ...`` runs this)::

    python benchmarks/storage_nixl_peer.py [--pages 256] [--layers 30] [--heads 3] [--head-dim 64]
                                           [--page-size 64] [--repeat 5] [--tenant-key KEY]

Starts a producer process (this script with ``--serve``): a ``page_first`` host pool of random KV
(seeded), stored through a ``StorageTier`` into a ``NixlPeerBackend`` with ``listen`` on loopback,
which copies the pages into its registered arena. This process is the consumer, and times, per
repetition and interleaved:

* ``raw``: one NIXL UCX READ per batch (``--batch`` pages) of the pages' ranges in the producer's
  arena into a destination registered once beforehand: the transport alone;
* ``backend``: ``NixlPeerBackend.get`` of the same pages into loose page buffers (per batch: a
  ``LOCATE`` round trip with a lease, registration of the destination, the READ, the ``RELEASE``);
* ``tier``: ``StorageTier.fetch`` of the pages into a zeroed host pool, each header and checksum
  (or keyed MAC with ``--tenant-key``) verified: what a decode server pays.

Every read is checked bit for bit against the KV the producer was given. GB = 1e9 B; the median
and best of ``--repeat``, the ratio to raw of the medians (target >= 0.8), and the consumer's CPU
seconds per GB of each path (steadier than wall time on a shared machine). Both processes run
on this machine: UCX goes through shared memory or CMA, as between two engines on one host.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import hicache  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent / "src"))

from storage_common import cores_available, cpu_pressure  # noqa: E402

from hicache.keys import TenantKey  # noqa: E402
from hicache.tiers.base import KVGeometry  # noqa: E402
from hicache.tiers.host import HostPool  # noqa: E402
from hicache.tiers.storage.base import PageIO  # noqa: E402
from hicache.tiers.storage.nixl import peer_auth  # noqa: E402
from hicache.tiers.storage.nixl import peer_wire as wire  # noqa: E402
from hicache.tiers.storage.nixl.agent import NixlAgent, nixl_available, pair  # noqa: E402
from hicache.tiers.storage.nixl.peer import NixlPeerBackend  # noqa: E402
from hicache.tiers.storage.page_format import HEADER_BYTES, PageCodec  # noqa: E402
from hicache.tiers.storage.tier import StorageTier  # noqa: E402

NAMESPACE = b"\x05" * 16


def geometry(args: argparse.Namespace) -> KVGeometry:
    return KVGeometry(2, args.layers, args.page_size, args.heads, args.head_dim, torch.float32)


def page_keys(n: int) -> list[bytes]:
    return [(1000 + i).to_bytes(16, "big") for i in range(n)]


async def host_pool(args: argparse.Namespace) -> HostPool:
    g = geometry(args)
    host = HostPool(g, args.pages * g.page_bytes, layout="page_first", pin_memory=False)
    await host.open()
    host.buffer.view(-1).uniform_(generator=torch.Generator().manual_seed(7))  # the same KV in both processes
    return host


def codec(args: argparse.Namespace) -> PageCodec:
    return PageCodec(NAMESPACE, geometry(args), TenantKey(args.tenant_key) if args.tenant_key else None)


# -- the producer ---------------------------------------------------------------------------------


async def serve(args: argparse.Namespace) -> None:
    host = await host_pool(args)
    g = geometry(args)
    capacity = args.pages * (HEADER_BYTES + g.page_bytes) + 2**20
    backend = NixlPeerBackend(listen="127.0.0.1:0", capacity=capacity, timeout_s=60)
    async with StorageTier("peer", backend, codec(args), host, batch_pages=args.batch) as tier:
        assert await tier.store(page_keys(args.pages), list(range(args.pages))) == args.pages
        assert backend.address is not None
        print(json.dumps({"port": backend.address[1]}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)  # until the consumer is done


# -- the consumer ---------------------------------------------------------------------------------


def locate_all(port: int, names: list[bytes]) -> tuple[bytes, int, int, list[wire.Located]]:
    """The producer's agent metadata, arena bounds and every page's ranges (for the raw READ)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        deadline = time.monotonic() + 30
        key, _ = peer_auth.peer_key(None, None)  # loopback, no secret: the exchange of a producer without one
        channel, hello = peer_auth.client_handshake(sock, key, deadline)
        metadata, address, size = wire.decode_hello(hello)
        channel.send(wire.LOCATE, wire.encode_keys(names), deadline)
        _, pages = wire.decode_located(channel.recv(deadline)[1], size, len(names))
    assert len(pages) == len(names), f"the producer has {len(pages)} of {len(names)} pages"
    return metadata, address, size, pages


async def consume(args: argparse.Namespace, port: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    n, g = args.pages, geometry(args)
    page = HEADER_BYTES + g.page_bytes
    total = n * page
    c = codec(args)
    names = c.storage_keys(page_keys(n))
    metadata, address, _size, located = locate_all(port, names)

    # raw: the transport alone, into one buffer registered once
    raw = NixlAgent("nixl-peer-raw", {"UCX": {}}, progress_thread=True)
    remote_name = raw.add_remote(metadata)
    dst = np.zeros(total, dtype=np.uint8)
    registration = raw.register([(int(dst.ctypes.data), total, 0)], "DRAM")
    batches = []
    for start in range(0, n, args.batch):
        part = range(start, min(n, start + args.batch))
        local = [(int(dst.ctypes.data) + i * page, page, 0) for i in part]
        remote = [(address + off, length, 0) for i in part for off, length in located[i].spans]
        batches.append(pair(local, remote))

    host = await host_pool(args)
    saved = host.page_major().clone()
    expected = None
    loose_h = np.zeros((n, HEADER_BYTES), np.uint8)
    loose_p = np.zeros((n, g.page_bytes), np.uint8)
    loose = [PageIO(memoryview(loose_h[i]), (memoryview(loose_p[i]),)) for i in range(n)]
    times: dict[str, list[float]] = {"raw": [], "backend": [], "tier": []}
    cpu: dict[str, list[float]] = {"raw": [], "backend": [], "tier": []}  # this process's CPU seconds
    consumer = NixlPeerBackend(peers=[f"127.0.0.1:{port}"], timeout_s=60)
    async with StorageTier("peer", consumer, c, host, batch_pages=args.batch) as tier:
        for _ in range(args.repeat):
            dst[:] = 0
            t0, c0 = time.perf_counter(), time.process_time()
            for rows_l, rows_r in batches:
                raw.run("READ", rows_l, rows_r, remote_name, deadline_s=60)
            times["raw"].append(time.perf_counter() - t0)
            cpu["raw"].append(time.process_time() - c0)
            if expected is None:
                expected = dst.copy()
                pages = expected.reshape(n, page)[:, HEADER_BYTES:]
                assert np.array_equal(pages, saved.view(torch.uint8).view(n, -1).numpy()), "raw read other bytes"
            else:
                assert np.array_equal(dst, expected)

            loose_h[:] = 0
            loose_p[:] = 0
            t0, c0 = time.perf_counter(), time.process_time()
            for start in range(0, n, args.batch):
                part = slice(start, min(n, start + args.batch))
                assert await consumer.get(names[part], loose[part]) == len(names[part])
            times["backend"].append(time.perf_counter() - t0)
            cpu["backend"].append(time.process_time() - c0)
            assert np.array_equal(np.concatenate([loose_h, loose_p], axis=1).reshape(-1), expected)

            host.buffer.zero_()
            t0, c0 = time.perf_counter(), time.process_time()
            assert await tier.fetch(page_keys(n), list(range(n))) == n
            times["tier"].append(time.perf_counter() - t0)
            cpu["tier"].append(time.process_time() - c0)
            assert torch.equal(host.page_major().view(torch.int32), saved.view(torch.int32)), "fetched pages differ"
        s = consumer.stats()
        assert (s.errors, s.timeouts, s.corrupt_pages, tier.failures) == (0, 0, 0, 0), s
    raw.deregister(registration)
    raw.remove_remote(remote_name)
    raw.close()
    gbps = {k: [total / t / 1e9 for t in v] for k, v in times.items()}
    return gbps, {k: statistics.median(v) / (total / 1e9) for k, v in cpu.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=64, help="pages per request (the tier's batch_pages)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tenant-key", default="")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the producer process
    args = p.parse_args(argv)
    why = nixl_available()
    if why is not None:
        raise SystemExit(why)
    torch.set_num_threads(1)
    if args.serve:
        anyio.run(serve, args)
        return 0
    print(f"cpu pressure at start: {cpu_pressure()}")
    cores_start = cores_available()
    producer = subprocess.Popen(
        [sys.executable, __file__, "--serve", *(argv if argv is not None else sys.argv[1:])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert producer.stdout is not None
        line = producer.stdout.readline()
        if not line:
            raise SystemExit("the producer process did not start")
        port = json.loads(line)["port"]
        gbps, cpu_per_gb = anyio.run(consume, args, port)
    finally:
        producer.communicate(input="", timeout=60)
    g = geometry(args)
    total = args.pages * (HEADER_BYTES + g.page_bytes)
    mac = "keyed BLAKE3 MACs" if args.tenant_key else "xxh3-64 checksums"
    print(f"\n{args.pages} pages x {g.page_bytes / 2**20:.2f} MiB ({total / 1e9:.2f} GB), {args.batch} pages a request, "
          f"producer and consumer processes on loopback, tier: {mac}, {args.repeat} repetitions")
    print(f"{'path':<9}{'median GB/s':>12}{'best GB/s':>11}{'x raw (median)':>16}{'x raw (paired)':>16}"
          f"{'CPU s/GB (median)':>19}{'cores busy':>12}")
    raw_median = statistics.median(gbps["raw"])
    for path, values in gbps.items():
        median = statistics.median(values)
        paired = statistics.median(v / r for v, r in zip(values, gbps["raw"], strict=True))
        print(f"{path:<9}{median:>12.2f}{max(values):>11.2f}{median / raw_median:>16.2f}{paired:>16.2f}"
              f"{cpu_per_gb[path]:>19.2f}{cpu_per_gb[path] * median:>12.2f}")
    print("(CPU: this process's, every thread; the producer's UCX progress thread is not counted. cores busy: CPU s/GB x "
          "GB/s, the cores the path kept busy on average)")
    bound = cpu_per_gb["raw"] / cpu_per_gb["tier"]
    print(f"CPU ratio raw / tier: {bound:.2f} (where the raw READ keeps every core busy, the tier's wall ratio can "
          f"be no higher); cores this process got: {cores_start:.2f} at start, {cores_available():.2f} at end")
    print(f"\ncpu pressure at end: {cpu_pressure()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
