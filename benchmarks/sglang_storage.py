"""SGLang HiCache's L3 through SGLang's own controller: hicache's file tier against SGLang's ``HiCacheFile``.

Usage (in the SGLang environment: ``make bench-sglang ARGS="..."``)::

    .venv-sglang/bin/python benchmarks/sglang_storage.py [--pages 256] [--layers 8] [--heads 8] [--head-dim 128]
        [--page-size 64] [--layout page_first_direct|page_first|layer_first] [--repeat 3] [--warm] [--dir DIR]
        [--only NAME ...] [--json out.json]       (NAME: sglang-file hicache-file hicache-file-copy
                                                    sglang-mooncake hicache-mooncake)

One SGLang ``HiCacheController`` (real, on CPU, a one-rank gloo group) over one host pool of
``--pages`` pages of random KV. Each configuration is attached in turn (SGLang's runtime attach),
then timed on the same pages, in an emptied folder:

* ``backup``: ``write_storage`` of every page until SGLang's backup ack (existence checks included);
* ``prefetch``: ``prefetch`` of the same tokens until the last ack (hit query included) into other
  host slots, cold by default (every file's page cache dropped first: ``fsync`` +
  ``posix_fadvise(DONTNEED)``, no privileges needed; ``--warm`` keeps it).

Configurations: ``sglang-file`` (SGLang's ``HiCacheFile``, its copy path: ``get_data_page`` /
``set_from_flat_data_page``), ``hicache-file`` (hicache's file tier, zero-copy ``interface_v1``, every
page checksummed on write and verified on read), ``hicache-file-copy`` (the same tier on SGLang's copy
path), and where Mooncake runs here (a ``mooncake_master`` on loopback, TCP) ``sglang-mooncake``
(SGLang's ``MooncakeStore``, zero-copy) and ``hicache-mooncake`` (hicache's Mooncake tier, zero-copy,
verified). Each run writes fresh pages (folders emptied, Mooncake cleared). The raw operation, measured next to each configuration in the same run: each page's bytes
written to a file of its own (``os.writev`` from the host pool, rename into place) and read back
(``os.preadv`` into the host pool), one file after the other, nothing checked; ``os.sync()`` before
each timed write, so neither pays for the other's dirty pages. For Mooncake (memory) the raw
operation is each page's bytes copied once, page by page. Every prefetch is
compared bit for bit with the pages written (outside the timed regions).

Configurations run in alternating order each repetition; the table gives median GB/s (GB = 1e9 B),
each configuration / the raw operation next to it, and hicache / HiCacheFile. Record the CPU
pressure printed with the figures: these machines are shared.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tests.sglang.conftest import import_sglang  # noqa: E402  (the torchvision stub, SGLang's imports)

import_sglang()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from hicache.bench.profiling import cpu_pressure  # noqa: E402
from hicache.integrations.sglang.host_pages import HostPages  # noqa: E402
from tests.sglang.harness import MODULE, Rig, Shape, fill, page_bytes, pools, tokens_for  # noqa: E402

FILE_CONFIGS = ("sglang-file", "hicache-file", "hicache-file-copy")
MOONCAKE_CONFIGS = ("sglang-mooncake", "hicache-mooncake")
CONFIGS = FILE_CONFIGS + MOONCAKE_CONFIGS


def attach(rig: Rig, name: str, folder: Path, mooncake: dict[str, Any] | None, segment: int) -> None:
    ctl = rig.controller
    if name == "sglang-file":
        ctl.attach_storage_backend("file", model_name=rig.model, storage_backend_extra_config={"file_storage_path": str(folder)})
        return
    if name == "sglang-mooncake":
        assert mooncake is not None
        extra = {
            "master_server_address": mooncake["master"], "metadata_server": mooncake["metadata_server"],
            "protocol": "tcp", "local_hostname": "127.0.0.1", "global_segment_size": segment, "device_name": "",
        }
        ctl.attach_storage_backend("mooncake", model_name=rig.model, storage_backend_extra_config=extra)
        return
    if name == "hicache-mooncake":
        assert mooncake is not None
        storage = [{**mooncake, "kind": "mooncake", "global_segment_size": segment, "key_prefix": "bench"}]
    else:
        storage = [{"kind": "file", "path": str(folder), "capacity": "1TiB"}]
    extra = {**MODULE, "interface_v1": int(name != "hicache-file-copy"), "storage": storage}
    ctl.attach_storage_backend("dynamic", model_name=rig.model, storage_backend_extra_config=extra)


def drop_cache(folder: Path) -> None:
    """Write back and drop the page cache of every file under ``folder`` (no privileges needed)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_write(pages: HostPages, page_ids: list[int], folder: Path) -> float:
    pieces = pages.page_pieces()
    start = time.perf_counter()
    for i, p in enumerate(page_ids):
        tmp, final = folder / f".{i}.tmp", folder / f"{i}.bin"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, list(pieces[p]))
        finally:
            os.close(fd)
        os.replace(tmp, final)
    return time.perf_counter() - start


def raw_read(pages: HostPages, page_ids: list[int], folder: Path) -> float:
    pieces = pages.page_pieces()
    start = time.perf_counter()
    for i, p in enumerate(page_ids):
        fd = os.open(folder / f"{i}.bin", os.O_RDONLY)
        try:
            os.preadv(fd, list(pieces[p]), 0)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def raw_copy(pages: HostPages, src: list[int], dst: list[int]) -> float:
    """The raw operation of an in-memory store: each page's bytes copied once, page by page."""
    pieces = pages.page_pieces()
    start = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        for a, b in zip(pieces[s], pieces[d], strict=True):
            np.copyto(b, a)
    return time.perf_counter() - start


def run_one(
    rig: Rig, name: str, work: Path, tokens: list[int], slots: torch.Tensor, warm: bool,
    mooncake: dict[str, Any] | None,
) -> dict[str, float]:
    host, ps = rig.host, rig.host.page_size
    n_pages = len(tokens) // ps
    nbytes = n_pages * host.get_dummy_flat_data_page().nbytes
    folder, raw_dir = work / name, work / f"raw-{name}"
    for d in (folder, raw_dir):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    pages = HostPages(host, attention="mla" if type(host).__name__.startswith("MLA") else "mha")
    page_ids = (slots[::ps] // ps).tolist()
    in_memory = name.endswith("mooncake")
    attach(rig, name, folder, mooncake, segment=2 * nbytes + 64 * 2**20)
    try:
        os.sync()  # each timed write starts with no dirty pages of an earlier one to write back
        if in_memory:
            spare = host.alloc(len(tokens))
            raw_w = raw_copy(pages, page_ids, (spare[::ps] // ps).tolist())
            host.free(spare)
        else:
            raw_w = raw_write(pages, page_ids, raw_dir)
        os.sync()
        start = time.perf_counter()
        written = rig.backup(slots, tokens, timeout_s=600)
        backup_s = time.perf_counter() - start
        assert written == len(tokens), f"{name}: backup wrote {written} of {len(tokens)} tokens"
        if not warm:
            drop_cache(raw_dir)
            drop_cache(folder)
        target = host.alloc(len(tokens))
        if in_memory:
            raw_r = raw_copy(pages, page_ids, (target[::ps] // ps).tolist())
        else:
            raw_r = raw_read(pages, (target[::ps] // ps).tolist(), raw_dir)
        host.free(target)
        start = time.perf_counter()
        back, hit, loaded = rig.prefetch(tokens, timeout_s=600)
        prefetch_s = time.perf_counter() - start
        assert hit == loaded == len(tokens), f"{name}: prefetch hit {hit}, loaded {loaded} of {len(tokens)}"
        assert torch.equal(page_bytes(host, back), page_bytes(host, slots)), f"{name}: prefetched bytes differ"
        host.free(back)
    finally:
        if in_memory:
            rig.controller.storage_backend.clear()  # the next run writes fresh pages
        rig.controller.detach_storage_backend()
        shutil.rmtree(raw_dir, ignore_errors=True)
    gb = nbytes / 1e9
    return {
        "backup_gbs": gb / backup_s, "raw_write_gbs": gb / raw_w,
        "prefetch_gbs": gb / prefetch_s, "raw_read_gbs": gb / raw_r,
    }


def start_master(work: Path, only: list[str] | None) -> tuple[dict[str, Any] | None, Any]:
    """A mooncake_master on loopback for the Mooncake configurations, when Mooncake runs here."""
    if only is not None and not set(only) & set(MOONCAKE_CONFIGS):
        return None, None
    from tests.mooncake_master import mooncake_client_available, start_mooncake

    why = mooncake_client_available()
    if why is None:
        try:
            (work / "mooncake").mkdir(parents=True, exist_ok=True)
            server, settings = start_mooncake(work / "mooncake")
            return {k: v for k, v in settings.items() if k != "global_segment_size"}, server
        except BaseException as exc:  # noqa: BLE001 - pytest's skip, when no master binary is there
            why = repr(exc)
    if only is not None:
        raise SystemExit(f"Mooncake does not run here: {why}")
    print(f"(Mooncake configurations left out: {why})")
    return None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--layout", default="page_first_direct", choices=("page_first_direct", "page_first", "layer_first"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="prefetch from the page cache (default: cold)")
    parser.add_argument("--dir", default=None, help="where the page files go (default: a temporary folder)")
    parser.add_argument("--only", nargs="*", choices=CONFIGS, default=None,
                        help="configurations to run (default: all; the Mooncake ones when Mooncake runs here)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    torch.set_num_threads(1)

    work = Path(args.dir or tempfile.mkdtemp(prefix="sglang-storage-"))
    work.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{work / 'gloo'}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    shape = Shape(layers=args.layers, heads=args.heads, head_dim=args.head_dim, page_size=args.page_size,
                  tokens=(args.pages + 2) * args.page_size)
    mooncake, master = start_master(work, args.only)
    configs = args.only or [*FILE_CONFIGS, *(MOONCAKE_CONFIGS if mooncake else ())]
    device, host = pools(args.layout, shape)
    rig = Rig(device, host, {"storage": [{"kind": "memory"}]})  # storage attached per configuration below
    rig.controller.detach_storage_backend()
    tokens = tokens_for(args.pages, args.page_size, seed=1)
    slots = host.alloc(len(tokens))
    fill(host, slots, seed=2)
    page_mib = host.get_dummy_flat_data_page().nbytes / 2**20
    print(f"{args.pages} pages of {page_mib:.2f} MiB ({args.layout}, {args.layers} layers, {args.heads} heads x "
          f"{args.head_dim}, {args.page_size} tokens, bf16), {'warm' if args.warm else 'cold'} prefetch, "
          f"{args.repeat} repeats; cpu pressure {cpu_pressure()}")
    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    try:
        for r in range(args.repeat):
            order = configs if r % 2 == 0 else list(reversed(configs))
            for name in order:
                results[name].append(run_one(rig, name, work, tokens, slots, args.warm, mooncake))
    finally:
        dist.destroy_process_group()
        if master is not None:
            master.stop()
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)

    med = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in results.items()}
    print(f"\n{'configuration':<20}{'backup GB/s':>12}{'/ raw':>8}{'prefetch GB/s':>15}{'/ raw':>8}")
    for name, m in med.items():
        print(f"{name:<20}{m['backup_gbs']:>12.3f}{m['backup_gbs'] / m['raw_write_gbs']:>8.2f}"
              f"{m['prefetch_gbs']:>15.3f}{m['prefetch_gbs'] / m['raw_read_gbs']:>8.2f}")
    print("(raw: a file a page written with writev and read with preadv; for Mooncake a memory copy a page)")
    for tier in ("file", "mooncake"):
        if f"sglang-{tier}" in med and f"hicache-{tier}" in med:
            s, h = med[f"sglang-{tier}"], med[f"hicache-{tier}"]
            print(f"hicache-{tier} / sglang-{tier}: backup {h['backup_gbs'] / s['backup_gbs']:.2f}x, "
                  f"prefetch {h['prefetch_gbs'] / s['prefetch_gbs']:.2f}x (every hicache page verified)")
    print(f"cpu pressure at end: {cpu_pressure()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": results, "median": med}, indent=2))


if __name__ == "__main__":
    main()
