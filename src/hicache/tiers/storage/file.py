"""``kind: file``: one file per page in a sharded directory, shared safely by processes and restarts.

Layout: ``<path>/<first two hex digits of the key>/<32 hex digits>.kv``, each file a canonical page
(header + payload). File names come only from page keys, never from user input.

* **Atomic writes**: a page is written to a temporary file in its shard, optionally fsynced, then
  renamed over the final name, so readers (this process or another) see a whole page or none. Two
  processes writing the same page both produce a valid file; the last rename wins.
* **fsync policy**: ``always`` (file data before the rename, the shard directory after: the page
  survives a power loss once ``set`` returns) or ``never`` (atomic but not durable; a page torn by a
  crash fails its checksum and is a miss).
* **Capacity**: bytes of page files this process knows of; the least recently used files are
  deleted to make room. Reads refresh a file's mtime, so recency survives restarts.
* **Restarts and other processes**: the index is rebuilt from the directory at ``open`` (oldest
  mtime first), and ``exists`` looks on disk for keys it does not know, so pages written by another
  process since are found. Several processes may share a directory; each enforces ``capacity`` on
  what it knows, so their total may exceed it briefly.

I/O path (measured with ``benchmarks/file_io_paths.py`` and ``benchmarks/storage.py``): writes run
in ``write_threads`` worker threads at once, because concurrent fsyncs share journal commits (one
thread: ~0.7-0.95x of a raw sequential write+fsync of the same bytes; four: ~0.75-0.95x; eight:
~0.9-1.0x). Reads run in one thread per batch that announces the next ``read_ahead`` files with
``posix_fadvise(WILLNEED)`` (so the disk has them all in flight) and ``preadv``s each into the header
and the payload pieces: the host-pool page itself, in either layout (``layer_first``: one piece per
component and layer): ~0.8x of a raw sequential cold read
of one file, against ~0.6x for plain file-by-file reads and ~0.8x for aiofiles, which pays a thread
hop per file.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field

from ...config import ByteSize
from .base import BackendSettings, PageIO, StorageBackend
from .lru_index import LruIndex

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_STALE_TMP_S = 15 * 60  # a temporary file this old belongs to a writer that died


class FileBackend(StorageBackend):
    kind = "file"
    max_batch = 64

    class Settings(BackendSettings):
        path: str = Field(min_length=1)
        capacity: ByteSize = 10 * 1024**3
        fsync: Literal["always", "never"] = "always"
        write_threads: int = Field(default=8, ge=1, le=64)
        read_ahead: int = Field(default=64, ge=0, le=256)

    settings: Settings

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.root = Path(os.path.expandvars(self.settings.path)).expanduser()
        self._index = LruIndex(self.settings.capacity)  # key -> file size, least recently used first
        self._write_limiter = anyio.CapacityLimiter(self.settings.write_threads)

    # -- paths ----------------------------------------------------------------------------------

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    @staticmethod
    def _key_of(name: str) -> bytes | None:
        stem = name.removesuffix(_SUFFIX)
        if len(name) != 32 + len(_SUFFIX) or not name.endswith(_SUFFIX):
            return None
        try:
            return bytes.fromhex(stem)
        except ValueError:
            return None

    # -- lifecycle ------------------------------------------------------------------------------

    async def _open(self) -> None:
        found = await anyio.to_thread.run_sync(self._scan)
        found.sort(key=lambda item: item[2])
        self._index.clear()
        for key, size, _ in found:  # oldest first
            self._index.remember(key, size)
        log.debug("file backend %s: %d pages, %d bytes", self.root, len(self._index), self._index.used)

    def _scan(self) -> list[tuple[bytes, int, float]]:
        """Every page file under the root as ``(key, size, mtime)``; stale temporaries removed."""
        self.root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[bytes, int, float]] = []
        now = time.time()
        with os.scandir(self.root) as shards:
            for shard in shards:
                if len(shard.name) != 2 or not shard.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(shard.path) as entries:
                    for entry in entries:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # removed by another process meanwhile
                        if entry.name.endswith(".tmp"):
                            if now - st.st_mtime > _STALE_TMP_S:
                                _unlink(entry.path)
                            continue
                        key = self._key_of(entry.name)
                        if key is not None and key.hex()[:2] == shard.name and entry.is_file(follow_symlinks=False):
                            found.append((key, st.st_size, st.st_mtime))
        return found

    def _usage(self) -> tuple[int, int, int]:
        return self._index.used, self.settings.capacity, len(self._index)

    # -- index ----------------------------------------------------------------------------------

    def _remember(self, key: bytes, size: int) -> None:
        self._index.remember(key, size)

    def _forget(self, key: bytes) -> None:
        self._index.forget(key)

    # -- the three operations -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            if key in self._index:
                continue
            # Not in our index: another process may have written it since we scanned. One stat of
            # a cached directory costs microseconds, less than a hop to a worker thread.
            try:
                st = os.stat(self.path_of(key))
            except OSError:
                return i
            self._remember(key, st.st_size)
        return len(keys)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        paths = [self.path_of(k) for k in keys]
        done, problem = await anyio.to_thread.run_sync(_read_pages, paths, into, self.settings.read_ahead)
        for key, io in zip(keys[:done], into[:done], strict=True):
            self._remember(key, io.nbytes)
        if problem is not None:
            self._forget(keys[done])
            if problem == "size":
                # A page file of the wrong size can never be valid (torn write under fsync=never,
                # or not ours): it was deleted in the thread.
                self.corrupt_pages += 1
        return done

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        fits, victims = self._index.plan(keys, [io.nbytes for io in pages])  # never over the capacity
        keys, pages = keys[:fits], pages[:fits]
        if not keys:
            return 0
        incoming = {k: io.nbytes for k, io in zip(keys, pages, strict=True)}
        for key in victims:
            self._forget(key)
        self.evicted_pages += len(victims)
        ok = [False] * len(keys)
        workers = min(self.settings.write_threads, len(keys))
        fsync = self.settings.fsync == "always"

        async def write_share(w: int) -> None:
            share = list(range(w, len(keys), workers))
            drop = [self.path_of(v) for v in victims] if w == 0 else []
            results = await anyio.to_thread.run_sync(
                _write_pages, [self.path_of(keys[i]) for i in share], [pages[i] for i in share], fsync, drop,
                limiter=self._write_limiter,
            )
            for i, good in zip(share, results, strict=True):
                ok[i] = good

        async with anyio.create_task_group() as tg:
            for w in range(workers):
                tg.start_soon(write_share, w)
        for key, good in zip(keys, ok, strict=True):
            if good:
                self._remember(key, incoming[key])
        return ok.index(False) if False in ok else len(keys)

    async def _delete(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self._forget(key)
        await anyio.to_thread.run_sync(lambda: [_unlink(self.path_of(k)) for k in keys])

    async def _clear(self) -> None:
        self._index.clear()
        await anyio.to_thread.run_sync(self._remove_all)

    def _remove_all(self) -> None:
        for key, _, _ in self._scan():
            _unlink(self.path_of(key))


# -- worker-thread functions (no shared state: paths and buffers in, results out) -----------------


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


def _preadv(fd: int, buffers: list[memoryview]) -> int:
    """Read the file from its start into ``buffers`` in order (any number of them); bytes read."""
    done = 0
    for i in range(0, len(buffers), _IOV_MAX):
        group = buffers[i : i + _IOV_MAX]
        n = os.preadv(fd, group, done)
        done += n
        if n != sum(len(b) for b in group):
            break
    return done


def _writev(fd: int, buffers: list[memoryview]) -> None:
    """Write ``buffers`` in order, all of them, or raise."""
    for i in range(0, len(buffers), _IOV_MAX):
        group = buffers[i : i + _IOV_MAX]
        if os.writev(fd, group) != sum(len(b) for b in group):
            raise OSError("short write")


def _read_pages(paths: list[Path], into: Sequence[PageIO], read_ahead: int) -> tuple[int, str | None]:
    """Read consecutive pages until one is missing or of the wrong size; ``(count, problem)``."""
    fds: dict[int, int | None] = {}

    def announce(j: int) -> None:
        try:
            fd = os.open(paths[j], os.O_RDONLY)
        except FileNotFoundError:
            fds[j] = None
            return
        fds[j] = fd
        if read_ahead:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)  # start the disk read now

    n = len(paths)
    for j in range(min(max(read_ahead, 1), n)):
        announce(j)
    try:
        for i in range(n):
            if read_ahead and i + read_ahead < n:
                announce(i + read_ahead)
            elif i not in fds:
                announce(i)
            fd = fds.pop(i)
            if fd is None:
                return i, "missing"
            try:
                expected = into[i].nbytes
                if os.fstat(fd).st_size != expected or _preadv(fd, into[i].buffers()) != expected:
                    _unlink(paths[i])
                    return i, "size"
                os.utime(fd)  # recency survives restarts (the index is rebuilt by mtime)
            finally:
                os.close(fd)
        return n, None
    finally:
        for fd in fds.values():
            if fd is not None:
                os.close(fd)


def _write_pages(paths: list[Path], pages: Sequence[PageIO], fsync: bool, drop: list[Path]) -> list[bool]:
    """Write each page atomically (temporary file, fsync, rename); delete ``drop`` first."""
    for path in drop:
        _unlink(path)
    results: list[bool] = []
    shards: set[Path] = set()
    for path, io in zip(paths, pages, strict=True):
        tmp = path.parent / f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _writev(fd, io.buffers())
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("file backend: cannot write %s: %s", path.name, exc)
            _unlink(tmp)
            results.append(False)
            continue
        shards.add(path.parent)
        results.append(True)
    if fsync:
        for shard in shards:  # make the renames durable
            fd = os.open(shard, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return results
