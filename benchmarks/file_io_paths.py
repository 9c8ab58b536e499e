"""Which I/O path should the file tier use? Times the candidates on the same bytes, in one run.

    python benchmarks/file_io_paths.py [--pages 128] [--page-mib 2.81] [--dir DIR]

Writes ``pages`` page files (header + payload) several ways and reads them back cold (the page
cache dropped per file with ``posix_fadvise(DONTNEED)``, which needs no privileges), next to the
raw operation on the same bytes: one sequential file written and fsynced, then read cold. Prints
each candidate's GB/s and its ratio to the raw figure. ``benchmarks/storage.py`` measures the tier
itself; this script is the evidence for the path the file backend takes.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HEADER = 128


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _syncfs(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        raise OSError(ctypes.get_errno(), "syncfs")


class Bench:
    def __init__(self, root: Path, pages: int, page_bytes: int) -> None:
        self.root = root
        self.pages = pages
        self.page_bytes = page_bytes
        self.total = pages * (page_bytes + HEADER)
        rng = np.random.default_rng(0)
        self.payload = [rng.integers(0, 255, page_bytes, dtype=np.uint8) for _ in range(pages)]
        self.header = np.zeros(HEADER, dtype=np.uint8)
        self.out = [np.empty(page_bytes, dtype=np.uint8) for _ in range(pages)]

    def fresh(self, name: str) -> Path:
        d = self.root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    # -- raw -----------------------------------------------------------------------------------
    def raw_write(self) -> float:
        d = self.fresh("raw")
        t = time.perf_counter()
        fd = os.open(d / "all", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for p in self.payload:
            os.write(fd, self.header)
            os.write(fd, p)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t

    def raw_read(self) -> float:
        path = self.root / "raw" / "all"
        _drop(path)
        t = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        for out in self.out:
            os.readv(fd, [self.header, out])
        os.close(fd)
        return time.perf_counter() - t

    # -- page-file writes ----------------------------------------------------------------------
    def _write_tmp(self, d: Path, i: int, fsync: bool) -> tuple[Path, Path]:
        tmp, final = d / f".{i}.tmp", d / f"{i:08x}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, [self.header, self.payload[i]])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        return tmp, final

    def _dirsync(self, d: Path) -> None:
        fd = os.open(d, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    def w_fsync_each(self) -> float:
        d = self.fresh("each")
        t = time.perf_counter()
        for i in range(self.pages):
            os.replace(*self._write_tmp(d, i, True))
        self._dirsync(d)
        return time.perf_counter() - t

    def w_fsync_after(self) -> float:
        d = self.fresh("after")
        t = time.perf_counter()
        names = [self._write_tmp(d, i, False) for i in range(self.pages)]
        for tmp, _ in names:
            fd = os.open(tmp, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        for tmp, final in names:
            os.replace(tmp, final)
        self._dirsync(d)
        return time.perf_counter() - t

    def w_syncfs(self) -> float:
        d = self.fresh("syncfs")
        t = time.perf_counter()
        names = [self._write_tmp(d, i, False) for i in range(self.pages)]
        fd = os.open(d, os.O_RDONLY)
        _syncfs(fd)
        for tmp, final in names:
            os.replace(tmp, final)
        os.fsync(fd)
        os.close(fd)
        return time.perf_counter() - t

    def w_threads(self, n: int = 4) -> float:
        d = self.fresh("threads")

        def work(k: int) -> None:
            for i in range(k, self.pages, n):
                os.replace(*self._write_tmp(d, i, True))

        t = time.perf_counter()
        ths = [threading.Thread(target=work, args=(k,)) for k in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        self._dirsync(d)
        return time.perf_counter() - t

    def w_nosync(self) -> float:
        d = self.fresh("nosync")
        t = time.perf_counter()
        for i in range(self.pages):
            os.replace(*self._write_tmp(d, i, False))
        return time.perf_counter() - t

    def w_aiofiles(self) -> float:
        import aiofiles

        d = self.fresh("aio")

        async def one(i: int) -> None:
            tmp, final = d / f".{i}.tmp", d / f"{i:08x}"
            async with aiofiles.open(tmp, "wb") as f:
                await f.write(self.header)
                await f.write(self.payload[i])
                await f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            os.replace(tmp, final)

        async def main() -> None:
            await asyncio.gather(*(one(i) for i in range(self.pages)))

        t = time.perf_counter()
        asyncio.run(main())
        self._dirsync(d)
        return time.perf_counter() - t

    # -- page-file reads -----------------------------------------------------------------------
    def _files(self, name: str) -> list[Path]:
        paths = [self.root / name / f"{i:08x}" for i in range(self.pages)]
        for p in paths:
            _drop(p)
        return paths

    def r_seq(self) -> float:
        paths = self._files("after")
        t = time.perf_counter()
        for p, out in zip(paths, self.out):
            fd = os.open(p, os.O_RDONLY)
            os.preadv(fd, [self.header, out], 0)
            os.close(fd)
        return time.perf_counter() - t

    def r_willneed(self) -> float:
        paths = self._files("after")
        t = time.perf_counter()
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        for fd, out in zip(fds, self.out):
            os.preadv(fd, [self.header, out], 0)
            os.close(fd)
        return time.perf_counter() - t

    def r_window(self, window: int = 8) -> float:
        """WILLNEED a few files ahead of the one being read (bounded read-ahead)."""
        paths = self._files("after")
        t = time.perf_counter()
        fds: list[int] = []
        for i in range(min(window, len(paths))):
            fds.append(os.open(paths[i], os.O_RDONLY))
            os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_WILLNEED)
        for i, out in enumerate(self.out):
            nxt = i + window
            if nxt < len(paths):
                fds.append(os.open(paths[nxt], os.O_RDONLY))
                os.posix_fadvise(fds[-1], 0, 0, os.POSIX_FADV_WILLNEED)
            os.preadv(fds[i], [self.header, out], 0)
            os.close(fds[i])
        return time.perf_counter() - t

    def r_threads(self, n: int = 4) -> float:
        paths = self._files("after")

        def work(k: int) -> None:
            for i in range(k, len(paths), n):
                fd = os.open(paths[i], os.O_RDONLY)
                os.preadv(fd, [np.empty(HEADER, np.uint8), self.out[i]], 0)
                os.close(fd)

        t = time.perf_counter()
        ths = [threading.Thread(target=work, args=(k,)) for k in range(n)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        return time.perf_counter() - t

    def r_aiofiles(self) -> float:
        import aiofiles

        paths = self._files("after")

        async def one(i: int) -> None:
            async with aiofiles.open(paths[i], "rb") as f:
                await f.readinto(memoryview(self.out[i]))  # header skipped below: same bytes moved

        async def main() -> None:
            await asyncio.gather(*(one(i) for i in range(self.pages)))

        t = time.perf_counter()
        asyncio.run(main())
        return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument(
        "--page-mib", type=float, default=2949120 / 2**20,
        help="payload MiB per page (default: 64 tokens x 30 layers x 3 KV heads x 64 dims fp32)",
    )
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary folder)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hicache-io-", dir=args.dir))
    try:
        b = Bench(root, args.pages, int(args.page_mib * 2**20))
        size = f"{b.page_bytes / 2**20:.2f} MiB ({b.total / 1e9:.2f} GB)"
        print(f"{args.pages} pages of {size} in {root}; best of {args.repeat}")
        rows = [
            ("write", "raw: one file, sequential write + fsync", b.raw_write, None),
            ("write", "page files: write + fsync + rename, each", b.w_fsync_each, "raw_w"),
            ("write", "page files: write all, then fsync each, rename", b.w_fsync_after, "raw_w"),
            ("write", "page files: write all, one syncfs, rename", b.w_syncfs, "raw_w"),
            ("write", "page files: 4 threads, write + fsync + rename", b.w_threads, "raw_w"),
            ("write", "page files: write + rename, no fsync", b.w_nosync, "raw_w"),
            ("write", "aiofiles: one task per page, fsync each", b.w_aiofiles, "raw_w"),
            ("read", "raw: one file, sequential cold read", b.raw_read, None),
            ("read", "page files: open + preadv, in order", b.r_seq, "raw_r"),
            ("read", "page files: WILLNEED all, then preadv", b.r_willneed, "raw_r"),
            ("read", "page files: WILLNEED 8 ahead, preadv", b.r_window, "raw_r"),
            ("read", "page files: 4 threads, preadv", b.r_threads, "raw_r"),
            ("read", "aiofiles: one task per page", b.r_aiofiles, "raw_r"),
        ]
        raw: dict[str, float] = {}
        for kind, label, fn, ref in rows:
            best = min(fn() for _ in range(args.repeat))
            gbs = b.total / best / 1e9
            if ref is None:
                raw["raw_w" if kind == "write" else "raw_r"] = gbs
                print(f"{kind:5} {label:50} {gbs:6.2f} GB/s")
            else:
                print(f"{kind:5} {label:50} {gbs:6.2f} GB/s  {gbs / raw[ref]:5.2f} x raw")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
