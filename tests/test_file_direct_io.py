"""``kind: file`` with ``direct_io: true``: page files written and read with ``O_DIRECT``.

The contract tests run the backend both ways (``file`` and ``file-direct`` in
``test_storage_backends.py``); these check what only direct I/O promises: the page cache is not
filled (``mincore`` over a mapping of the file), files are exactly the page's bytes (the write's
padding is cut off), pages written one way read back the other, and a file system that refuses
``O_DIRECT`` falls back to buffered I/O with the same bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from hicache.tiers.storage import HEADER_BYTES, PageIO, page_files
from hicache.tiers.storage.file import FileBackend

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")

PAYLOAD = 3 * 4096 + 1000  # neither a multiple of the alignment nor of a sector


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(4, "big") * 4 for i in range(1, n + 1)]


def pages(n: int, seed: int = 0, payload: int = PAYLOAD) -> list[PageIO]:
    rng = np.random.default_rng(seed)
    return [PageIO.of(rng.integers(0, 256, HEADER_BYTES, dtype=np.uint8),
                      *np.split(rng.integers(0, 256, payload, dtype=np.uint8), [100, 5000]))
            for _ in range(n)]


def empty(n: int, payload: int = PAYLOAD) -> list[PageIO]:
    return [PageIO.of(np.zeros(HEADER_BYTES, np.uint8), np.zeros(payload, np.uint8)) for _ in range(n)]


def raw(io: PageIO) -> bytes:
    return b"".join(bytes(b) for b in io.buffers())


def resident_fraction(path: Path) -> float:
    """The share of the file's pages in the page cache (``mincore`` over a fresh mapping: mapping
    it and asking fault nothing in)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    npages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * npages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        view = np.frombuffer(m, dtype=np.uint8)
        failed = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
        del view  # the mapping closes with no view of it left
    if failed:
        pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return sum(v & 1 for v in vec) / npages


async def test_direct_pages_round_trip_exactly_and_skip_the_page_cache(tmp_path: Path) -> None:
    written = pages(6)
    async with FileBackend(path=str(tmp_path / "pages"), direct_io=True) as backend:
        assert await backend.set(keys(6), written) == 6
        if page_files._no_direct:
            pytest.skip("this file system takes no O_DIRECT")
        files = [backend.path_of(k) for k in keys(6)]
        for f in files:
            assert f.stat().st_size == HEADER_BYTES + PAYLOAD  # the padding was cut off
        assert max(resident_fraction(f) for f in files) == 0.0, "direct writes filled the page cache"
        back = empty(6)
        assert await backend.get(keys(6), back) == 6
        assert [raw(b) for b in back] == [raw(w) for w in written]
        assert max(resident_fraction(f) for f in files) == 0.0, "direct reads filled the page cache"


async def test_the_page_cache_fills_without_direct_io(tmp_path: Path) -> None:
    """The control: the same check sees a buffered write's pages (so the one above can fail)."""
    async with FileBackend(path=str(tmp_path / "pages")) as backend:
        assert await backend.set(keys(2), pages(2)) == 2
        assert min(resident_fraction(backend.path_of(k)) for k in keys(2)) > 0.5


@pytest.mark.parametrize("write_direct", [True, False])
async def test_pages_written_one_way_read_back_the_other(tmp_path: Path, write_direct: bool) -> None:
    root = str(tmp_path / "pages")
    written = pages(4, seed=3)
    async with FileBackend(path=root, direct_io=write_direct) as backend:
        assert await backend.set(keys(4), written) == 4
    async with FileBackend(path=root, direct_io=not write_direct) as backend:
        back = empty(4)
        assert await backend.get(keys(4), back) == 4
    assert [raw(b) for b in back] == [raw(w) for w in written]


async def test_a_truncated_or_grown_file_is_a_corrupt_miss_through_direct_reads(tmp_path: Path) -> None:
    async with FileBackend(path=str(tmp_path / "pages"), direct_io=True) as backend:
        assert await backend.set(keys(3), pages(3)) == 3
        first, second = backend.path_of(keys(3)[1]), backend.path_of(keys(3)[2])
        os.truncate(first, HEADER_BYTES + PAYLOAD - 7)
        with open(second, "ab") as f:
            f.write(b"x" * 5000)
        back = empty(3)
        assert await backend.get(keys(3), back) == 1  # the first page only; the second ends the read
        assert backend.corrupt_pages == 1


async def test_a_file_system_without_o_direct_falls_back_to_buffered_io(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault injected into ``fcntl`` (``EINVAL``, what a file system without direct I/O says):
    the same pages, written and read buffered, one warning."""
    real = page_files.fcntl.fcntl

    def refusing_fcntl(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == page_files.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(page_files.fcntl, "fcntl", refusing_fcntl)
    monkeypatch.setattr(page_files, "_no_direct", set())
    written = pages(3, seed=5)
    with caplog.at_level(logging.WARNING, logger="hicache.tiers.storage.file"):
        async with FileBackend(path=str(tmp_path / "pages"), direct_io=True) as backend:
            assert await backend.set(keys(3), written) == 3
            back = empty(3)
            assert await backend.get(keys(3), back) == 3
    assert [raw(b) for b in back] == [raw(w) for w in written]
    assert sum("takes no O_DIRECT" in r.getMessage() for r in caplog.records) == 1
    assert page_files._no_direct  # remembered: the next file on that device is not asked again


async def test_a_transfer_the_file_system_refuses_goes_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Faults injected into ``pwrite`` and ``preadv`` of descriptors with ``O_DIRECT`` set (``EINVAL``:
    what a device needing a larger alignment says once the flag was taken): the same pages, buffered."""
    real_pwrite, real_preadv = os.pwrite, os.preadv

    def direct(fd: int) -> bool:
        return bool(page_files.fcntl.fcntl(fd, page_files.fcntl.F_GETFL) & os.O_DIRECT)

    def refusing_pwrite(fd: int, data: object, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    def refusing_preadv(fd: int, buffers: object, offset: int) -> int:
        if direct(fd):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    monkeypatch.setattr(page_files, "_no_direct", set())
    written = pages(3, seed=7)
    with caplog.at_level(logging.WARNING, logger="hicache.tiers.storage.file"):
        async with FileBackend(path=str(tmp_path / "pages"), direct_io=True) as backend:
            assert await backend.set(keys(3), written) == 3
            page_files._no_direct.clear()  # reads try O_DIRECT again, and are refused too
            monkeypatch.setattr(os, "preadv", refusing_preadv)
            back = empty(3)
            assert await backend.get(keys(3), back) == 3
    assert [raw(b) for b in back] == [raw(w) for w in written]
    assert sum("takes no O_DIRECT" in r.getMessage() for r in caplog.records) == 2
