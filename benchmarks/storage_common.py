"""What the storage benchmarks share: the raw file operations a tier is compared with, and readings
of how busy the machine is.

A helper module, not a script: ``storage.py`` runs the other storage benchmarks (``--codecs``,
``--backend ...``) and they borrow these functions, so the functions live here, where both can
import them without an import circle. The importer sets ``sys.path`` up (this folder, and ``src``
when hicache is not installed). GB = 1e9 B.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np

from hicache.tiers.storage.page_format import HEADER_BYTES


def cpu_pressure() -> str:
    try:
        return Path("/proc/pressure/cpu").read_text().strip()
    except OSError:
        return "(unreadable)"


def fsync(path: Path, drop_cache: bool = False) -> None:
    """fsync a file or folder; with ``drop_cache``, then evict the file from the page cache (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        if drop_cache:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raw_write(path: Path, header: np.ndarray, pages: np.ndarray, sync: bool, cpu: list[float] | None = None) -> float:
    """One file: header + payload per page with ``os.write``, one fsync at the end; seconds (and
    the CPU seconds of the timed part appended to ``cpu``)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        for page in pages:
            written += os.write(fd, header) + os.write(fd, page)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    assert written == len(pages) * (HEADER_BYTES + pages.shape[1]), "short raw write"
    return elapsed


def raw_read(path: Path, header: np.ndarray, into: np.ndarray, cpu: list[float] | None = None) -> float:
    """Read the raw file back cold, page by page, with ``os.readv``; seconds."""
    fsync(path, drop_cache=True)
    c0 = time.process_time()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        got = sum(os.readv(fd, [header, page]) for page in into)
    finally:
        os.close(fd)
    elapsed = time.perf_counter() - t0
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    assert got == len(into) * (HEADER_BYTES + into.shape[1]), "short raw read"
    return elapsed


def cores_available() -> float:
    """How many cores this process gets right now: what two threads hash at once over what one
    hashes alone (BLAKE3 releases the GIL), about 2.0 on two free cores, 1.0 when another job holds one."""
    import blake3

    data = np.random.default_rng(0).integers(0, 256, 16 * 2**20, dtype=np.uint8)

    def work() -> None:
        for _ in range(4):
            blake3.blake3(data).digest()

    t0 = time.perf_counter()
    work()
    one = time.perf_counter() - t0
    threads = [threading.Thread(target=work) for _ in range(2)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 2 * one / (time.perf_counter() - t0)
