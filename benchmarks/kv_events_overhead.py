"""What KV events cost the cache under a flood: request latency with events off and on, in one run.

Usage::

    python benchmarks/kv_events_overhead.py [--rounds 5] [--clients 8] [--conversations 32] [--json out.json]

A burst of ``--clients`` concurrent multi-turn clients over ``--conversations`` conversations whose
history is several times every tier (device 64 pages, host 128, a file tier of 256 that evicts):
every request is a lookup, a retrieve of its hit (``wait_all``: the KV on the device, what a
prefill waits for: the TTFT the cache adds) and a store of the new pages, so pages are stored,
backed up, written, evicted and read back through every tier all the time, and each change is an
event. Modes, interleaved round by round on fresh caches (the same trace each):

* ``off``: no events;
* ``on``: events published, a subscriber reading them (a router: a process of its own);
* ``on-stalled``: published to a subscriber process that never reads (ZMQ drops past its
  high-water mark; the cache must not notice);
* ``on-no-subscriber``: published to nobody.

Printed: each mode's mean request latency (median of the rounds), the ratio to ``off`` (target:
<= 1.02 for every mode), events published, batches sent and events dropped. Record
/proc/pressure/cpu with the numbers.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import anyio  # noqa: E402
import torch  # noqa: E402

from hicache import HiCache, load_config  # noqa: E402

MODES = ("off", "on", "on-stalled", "on-no-subscriber")
PAGE = 16


def _config(folder: Path, mode: str) -> object:
    model = {"name": "events-bench", "num_layers": 8, "num_kv_heads": 2, "head_dim": 64, "dtype": "float16"}
    probe = load_config(overrides={"model": model, "page_size": PAGE}, env={})
    pb = probe.page_bytes
    over = {
        "model": model, "page_size": PAGE,
        "tiers": {"device": {"capacity": 64 * pb}, "host": {"capacity": 128 * pb},
                  "storage": [{"kind": "file", "name": "disk", "path": str(folder), "capacity": 256 * pb,
                               "fsync": "never"}]},
        "policies": {"write": "write_through", "prefetch": "wait_complete", "prefetch_threshold_tokens": 0},
    }
    if mode != "off":
        over["kv_events"] = {"enabled": True, "endpoint": "tcp://127.0.0.1:*", "hwm": 64,
                             "batch_interval_s": float(os.environ.get("EV_INTERVAL", "0.05"))}
    return load_config(overrides=over, env={})


def _trace(conversations: int, turns: int, seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    convs = [[rng.randrange(1, 50_000) for _ in range(4 * PAGE + 3)] for _ in range(conversations)]
    out = []
    for _ in range(turns):
        order = list(range(conversations))
        rng.shuffle(order)
        for c in order:
            convs[c] += [rng.randrange(1, 50_000) for _ in range(2 * PAGE)]
            out.append((c, list(convs[c])))
    return out


_READER = """
import sys, zmq
sock = zmq.Context.instance().socket(zmq.SUB)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.RCVHWM, 16)
sock.connect(sys.argv[1])
read = sys.argv[2] == "read"
print("ready", flush=True)
while True:
    if read:
        sock.recv_multipart()
    else:
        sys.stdin.read()  # never reads the socket: it fills, then ZMQ drops
"""


class Reader:
    """A subscriber in a process of its own, as a router is: it reads (``on``) or never does
    (``on-stalled``: its socket fills)."""

    def __init__(self, endpoint: str, read: bool) -> None:
        import subprocess

        self.proc = subprocess.Popen([sys.executable, "-c", _READER, endpoint, "read" if read else "stall"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == b"ready"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()


async def _one(mode: str, trace: list[tuple[int, list[int]]], clients: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="hicache-events-bench-") as folder:
        cfg = _config(Path(folder), mode)
        m = cfg.model
        async with HiCache.from_config(cfg) as cache:
            reader = None
            if mode in ("on", "on-stalled"):
                reader = Reader(cache.events.sink.bound_endpoint, read=mode == "on")
                await anyio.sleep(0.2)
            kv_cache: dict[int, torch.Tensor] = {}
            latencies: list[float] = []
            queue = list(trace)
            busy: set[int] = set()

            async def client() -> None:
                while queue:
                    i = next((k for k, (c, _) in enumerate(queue) if c not in busy), None)
                    if i is None:
                        await anyio.sleep(0.001)
                        continue
                    c, tokens = queue.pop(i)
                    busy.add(c)
                    try:
                        t0 = time.perf_counter()
                        await cache.lookup(tokens)
                        async with cache.retrieve(tokens) as view:
                            await view.wait_all()
                        latencies.append(time.perf_counter() - t0)
                        kv = kv_cache.get(c)
                        if kv is None or kv.shape[2] < len(tokens):
                            kv = torch.randn(2, m.num_layers, len(tokens) + 256, m.num_kv_heads, m.head_dim,
                                             dtype=m.torch_dtype)
                            kv_cache[c] = kv
                        await cache.store(tokens, kv[:, :, : len(tokens)])
                    finally:
                        busy.discard(c)

            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for _ in range(clients):
                    tg.start_soon(client)
            await cache.wait_idle()
            wall = time.perf_counter() - started
            out = {"mean_latency_s": statistics.fmean(latencies), "wall_s": wall}
            if cache.events is not None:
                pub = cache.events.sink
                await anyio.to_thread.run_sync(pub.flush)
                out |= {"stored_events": cache.events.stored_events, "removed_events": cache.events.removed_events,
                        "sent_batches": pub.sent_batches, "dropped_batches": pub.dropped_batches,
                        "dropped_events": pub.dropped_events}
            if reader is not None:
                reader.close()
            return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    trace = _trace(args.conversations, args.turns, args.seed)
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (modes if r % 2 == 0 else modes[::-1]):  # alternate the order: no mode always runs first
            runs[mode].append(anyio.run(_one, mode, trace, args.clients))
    pressure = Path("/proc/pressure/cpu").read_text().splitlines()[0] if Path("/proc/pressure/cpu").exists() else ""
    base = statistics.median(x["mean_latency_s"] for x in runs["off"]) if "off" in runs else None
    print(f"{len(trace)} requests a round, {args.clients} clients, {args.rounds} rounds; {pressure}")
    print(f"{'mode':>18} {'latency ms':>11} {'/ off':>7} {'events':>8} {'batches':>8} {'dropped':>8}")
    summary = {}
    for mode, xs in runs.items():
        lat = statistics.median(x["mean_latency_s"] for x in xs)
        ratio = lat / base if base else float("nan")
        events = int(statistics.median(x.get("stored_events", 0) + x.get("removed_events", 0) for x in xs))
        batches = int(statistics.median(x.get("sent_batches", 0) for x in xs))
        dropped = int(statistics.median(x.get("dropped_batches", 0) + x.get("dropped_events", 0) for x in xs))
        summary[mode] = {"latency_s": lat, "ratio_to_off": ratio, "events": events, "batches": batches,
                         "dropped": dropped, "rounds": xs}
        print(f"{mode:>18} {lat * 1e3:11.2f} {ratio:7.3f} {events:8d} {batches:8d} {dropped:8d}")
    worst = max((s["ratio_to_off"] for m, s in summary.items() if m != "off"), default=float("nan"))
    print(f"worst events-on / off: {worst:.3f} (target <= 1.02: {'met' if worst <= 1.02 else 'missed'})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
