"""The four pressure scenarios of issue 10, run as a user would, with a verdict per run.

1. write-through reaches storage: device 8, host 16 pages, a storage tier (file, Valkey, Mooncake),
   12 prompts of 6 pages + 5 tokens stored back to back, then the cache is closed: every page must be
   in storage (a fresh client counts them), nothing lost.
2. retrieve gives what lookup found: device 6, host 128, 10 prompts of 4 pages, retrieved one after
   another under each write policy.
3. concurrent stores sharing a prefix: device 8, host 256, 24 tasks store base (4 pages) + own (3
   pages) and retrieve it: no store drops a page.
4. end to end: ``hicache bench multiturn`` with the host at 25% of the KV and the file tier below;
   hierarchical hit rate over the page-aligned ideal of KV that was computed (the last token of each
   answer is never fed to the model, so its KV never exists).

Sizes in pages of 16 tokens, geometry 3 layers x 2 KV heads x 16. ``--runs N`` repeats everything;
``--burners 2`` starts two CPU-burning processes beside it. Exit status 0 when every run held.

    python benchmarks/pressure_scenarios.py --runs 20 --burners 2 [--bench-size small|make-run]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import anyio  # noqa: E402
import torch  # noqa: E402

from hicache import HiCache, load_config  # noqa: E402
from hicache.keys import as_token_bytes, chain_keys  # noqa: E402
from hicache.soak.servers import (  # noqa: E402
    ServerProcess,
    free_port,
    mooncake_master_binary,
    start_mooncake_master,
    valkey_argv,
    valkey_binary,
)
from hicache.tiers.storage.registry import resolve_backend  # noqa: E402

PAGE = 16
PAGE_BYTES = 2 * 3 * PAGE * 2 * 16 * 4
GEOMETRY = {"name": "pressure-model", "num_layers": 3, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}


def config(device: int, host: int, storage: list[dict[str, Any]] | None = None, **policies: Any):
    tiers: dict[str, Any] = {"device": {"capacity": device * PAGE_BYTES}, "host": {"capacity": host * PAGE_BYTES}}
    if storage:
        tiers["storage"] = storage
    return load_config(overrides={"model": GEOMETRY, "page_size": PAGE, "tiers": tiers, "policies": policies,
                                  "controller": {"shutdown_timeout_s": 60}}, env={})


def kv(n: int, seed: int) -> torch.Tensor:
    return torch.randn((2, 3, n, 2, 16), generator=torch.Generator().manual_seed(seed))


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 50_000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


async def count_present(entry: dict[str, Any], keys: list[bytes]) -> int:
    options = {k: v for k, v in entry.items() if k not in ("kind", "name")}
    async with resolve_backend(entry["kind"])(**options) as backend:
        return sum([await backend.exists([k]) for k in keys])


async def scenario_1(entry: dict[str, Any]) -> tuple[bool, str]:
    work = [(tokens(6 * PAGE + 5, i), kv(6 * PAGE + 5, i)) for i in range(12)]
    async with HiCache.from_config(config(8, 16, [entry], write="write_through", prefetch="wait_complete")) as cache:
        for t, k in work:
            await cache.store(t, k)
        seed = cache.controller.tree.seed
    lost = cache.stats().lost_pages
    keys = [key for t, _ in work for key in chain_keys(seed, as_token_bytes(t), PAGE)]
    found = await count_present(entry, keys)
    return found == len(keys) and lost == 0, f"{found}/{len(keys)} pages in {entry['kind']}, lost {lost}"


async def scenario_2(write: str) -> tuple[bool, str]:
    work = [(tokens(4 * PAGE, i), kv(4 * PAGE, i)) for i in range(10)]
    short = 0
    async with HiCache.from_config(config(6, 128, write=write)) as cache:
        for t, k in work:
            await cache.store(t, k)
        for t, _ in work:
            hit = await cache.lookup(t)
            async with cache.retrieve(t) as view:
                short += view.tokens != hit.tokens
    return short == 0, f"{write}: {short}/10 retrieves shorter than lookup"


async def scenario_3() -> tuple[bool, str]:
    base, base_kv = tokens(4 * PAGE, 999), kv(4 * PAGE, 999)
    dropped: list[int] = []
    async with HiCache.from_config(config(8, 256)) as cache:

        async def one(i: int) -> None:
            t = base + tokens(3 * PAGE, i)
            result = await cache.store(t, torch.cat([base_kv, kv(3 * PAGE, i)], dim=2))
            dropped.append(result.dropped_tokens)
            async with cache.retrieve(t):
                pass

        async with anyio.create_task_group() as tg:
            for i in range(24):
                tg.start_soon(one, i)
        total = cache.stats().dropped_pages
    return sum(dropped) == 0 and total == 0, f"dropped tokens {sum(dropped)}, dropped_pages {total}"


def scenario_4(size: str, out: Path) -> tuple[bool, str]:
    argv = [sys.executable, "-m", "hicache.cli", "bench", "multiturn", "--configs", "hierarchical",
            "--host-fraction", "0.25", "--quiet", "--no-plot", "--out", str(out)]
    if size == "small":
        argv += ["--num-clients", "6", "--num-rounds", "4"]  # the device still holds one whole request
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        return False, f"bench failed: {proc.stderr[-500:]}"
    records = json.loads((out / "results.json").read_text())["configurations"]["hierarchical"]["records"]
    hit = sum(r["cached_tokens"] for r in records)
    # The shared prefix of a turn ends with the previous answer, whose last token's KV was never computed.
    computed = sum(max(0, (r["ideal_tokens"] - 1)) // PAGE * PAGE for r in records)
    ratio = hit / computed if computed else 1.0
    return ratio >= 0.98, f"hit/ideal (page-aligned, computed) {ratio:.3f}"


def start_servers(folder: Path) -> tuple[list[ServerProcess], list[dict[str, Any]]]:
    servers, entries = [], [{"kind": "file", "name": "store", "path": str(folder / "pages"), "fsync": "never"}]
    binary = valkey_binary()
    if binary:
        port = free_port()
        servers.append(ServerProcess(valkey_argv(binary, port, folder), port, folder / "valkey.log").start())
        entries.append({"kind": "redis", "name": "store", "url": f"redis://127.0.0.1:{port}/0"})
    binary = mooncake_master_binary()
    if binary:
        master = start_mooncake_master(binary, folder)
        servers.append(master.server)
        rpc, http = master.rpc_port, master.http_port
        entries.append({"kind": "mooncake", "name": "store", "master": f"127.0.0.1:{rpc}",
                        "metadata_server": f"http://127.0.0.1:{http}/metadata", "protocol": "tcp",
                        "local_hostname": "127.0.0.1", "global_segment_size": 0, "local_buffer_size": "16MiB"})
    return servers, entries


async def one_run(entries: list[dict[str, Any]], run: int, folder: Path, size: str) -> list[tuple[str, bool, str]]:
    out: list[tuple[str, bool, str]] = []
    for entry in entries:
        fresh = dict(entry)
        if fresh["kind"] == "file":
            fresh["path"] = str(folder / f"pages-{run}")
        else:
            fresh["key_prefix"] = f"run{run}-{time.monotonic_ns()}"
        out.append(("1 write-through reaches storage", *await scenario_1(fresh)))
    for write in ("write_through", "write_through_selective", "write_back"):
        out.append(("2 retrieve == lookup", *await scenario_2(write)))
    out.append(("3 concurrent shared-prefix stores", *await scenario_3()))
    out.append(("4 bench multiturn, host 25% + file", *scenario_4(size, folder / f"bench-{run}")))
    return out


async def main_async(args: argparse.Namespace, folder: Path, entries: list[dict[str, Any]]) -> bool:
    holder = None
    mooncake = [e for e in entries if e["kind"] == "mooncake"]
    if mooncake:  # the caches mount no segment: this client holds their pages
        options = {k: v for k, v in mooncake[0].items() if k not in ("kind", "name")}
        holder = resolve_backend("mooncake")(**(options | {"global_segment_size": "256MiB", "key_prefix": "holder"}))
        await holder.open()
    all_ok = True
    try:
        for run in range(args.runs):
            results = await one_run(entries, run, folder, args.bench_size)
            ok = all(r[1] for r in results)
            all_ok &= ok
            print(f"run {run + 1:2d}/{args.runs}: {'OK ' if ok else 'FAIL'}  "
                  + "; ".join(f"{name.split()[0]}: {detail}" for name, passed, detail in results), flush=True)
    finally:
        if holder is not None:
            await holder.aclose()
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--burners", type=int, default=0, help="CPU-burning processes to run beside")
    parser.add_argument("--bench-size", choices=["small", "make-run"], default="small")
    args = parser.parse_args()
    torch.set_num_threads(1)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    try:
        with tempfile.TemporaryDirectory(prefix="hicache-pressure-") as tmp:
            servers, entries = start_servers(Path(tmp))
            try:
                ok = anyio.run(main_async, args, Path(tmp), entries)
            finally:
                for server in servers:
                    server.stop()
    finally:
        for proc in burners:
            proc.kill()
            proc.wait()
    print("all runs held" if ok else "SOME RUNS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
