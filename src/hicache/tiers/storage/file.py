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

**The folder is untrusted** (other processes, other users may write there):

* page files are opened with ``O_NONBLOCK | O_NOFOLLOW`` and used only if ``fstat`` says they are
  regular files; a FIFO, socket, device, folder or symbolic link in a page's place is a corrupt
  page (counted, removed when that is safe: links and special files are unlinked, never followed),
  never waited on;
* nothing below the root is reached through a symbolic link: shard folders are opened with
  ``O_NOFOLLOW`` and every page is opened, written, renamed and unlinked relative to its shard's
  descriptor (``dir_fd``), so a shard replaced by a link to elsewhere is refused (logged once), and
  its pages are misses and never written; the root itself may be a link (you chose it);
* a page file that cannot be opened (``EACCES``, ``ELOOP``) ends the read there: the pages before
  it are served, and no descriptor outlives the call.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field, field_validator

from ...config import ByteSize
from ...errors import ConfigError
from .base import BackendSettings, PageIO, StorageBackend
from .lru_index import LruIndex

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

_SUFFIX = ".kv"
_STALE_TMP_S = 15 * 60  # a temporary file this old belongs to a writer that died
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PAGE_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | _CLOEXEC
_PAGE_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_SHARD = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_ROOT = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC
_VAR = re.compile(r"\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)")  # $VAR; ${VAR} is load_config's (strict there)
#: Why a page was not read: "missing" is a plain miss, every other reason a corrupt page.
_CORRUPT = frozenset({"size", "special", "link", "unreadable", "refused"})


def expand_path(path: str) -> Path:
    """``~`` and ``$VAR`` expanded; ``ValueError`` naming a variable that is not set.

    ``${VAR}`` is expanded (strictly) by ``load_config``; what reaches here in that form was written
    ``$${VAR}`` there, a literal. ``os.path.expandvars`` would leave an unset ``$VAR`` as it is, and
    a folder named ``$VAR`` would appear.
    """

    def value(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in os.environ:
            raise ValueError(
                f"environment variable {name} in path {path!r} is not set: set it, or write the path out"
            )
        return os.environ[name]

    return Path(_VAR.sub(value, path)).expanduser()


class FileBackend(StorageBackend):
    kind = "file"
    max_batch = 64

    class Settings(BackendSettings):
        path: str = Field(min_length=1)
        capacity: ByteSize = 10 * 1024**3
        fsync: Literal["always", "never"] = "always"
        write_threads: int = Field(default=8, ge=1, le=64, strict=True)
        read_ahead: int = Field(default=64, ge=0, le=256, strict=True)

        @field_validator("path")
        @classmethod
        def _usable_path(cls, path: str) -> str:
            where = expand_path(path)
            if where.exists() and not where.is_dir():
                raise ValueError(f"{str(where)!r} is a file, not a folder: point `path` at a folder (created if missing)")
            return path

    settings: Settings

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.root = expand_path(self.settings.path)
        self._index = LruIndex(self.settings.capacity)  # key -> file size, least recently used first
        self._write_limiter = anyio.CapacityLimiter(self.settings.write_threads)
        self._refused: set[str] = set()  # shard folders already reported as links (logged once each)

    # -- paths ----------------------------------------------------------------------------------

    def path_of(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + _SUFFIX)

    @staticmethod
    def _place(key: bytes) -> tuple[str, str]:
        """``(shard, file name)`` of a page: both come from the key alone."""
        name = key.hex()
        return name[:2], name + _SUFFIX

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
        try:
            found = await anyio.to_thread.run_sync(self._scan)
        except OSError as exc:
            raise ConfigError(
                f"file tier: cannot use {str(self.root)!r} as its folder ({exc.strerror or exc}): set `path` to a "
                "folder this process can create, read and write"
            ) from exc
        found.sort(key=lambda item: item[2])
        self._index.clear()
        for key, size, _ in found:  # oldest first
            self._index.remember(key, size)
        log.debug("file backend %s: %d pages, %d bytes", self.root, len(self._index), self._index.used)

    def _scan(self, remove: bool = False) -> list[tuple[bytes, int, float]]:
        """Every page file under the root as ``(key, size, mtime)``; stale temporaries removed.

        With ``remove``, page files and temporaries are deleted instead (``clear``).
        """
        found: list[tuple[bytes, int, float]] = []
        now = time.time()
        with _Folder(self.root, self._refused, create=True) as folder:
            with os.scandir(folder.fd) as shards:
                names = [s.name for s in shards if len(s.name) == 2]
            for shard in names:
                try:
                    sfd = folder.shard(shard)
                except _Refused:
                    continue
                if sfd is None:
                    continue
                with os.scandir(sfd) as entries:
                    for entry in entries:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue  # removed by another process meanwhile
                        if entry.name.endswith(".tmp"):
                            if remove or now - st.st_mtime > _STALE_TMP_S:
                                _unlink_at(sfd, entry.name)
                            continue
                        key = self._key_of(entry.name)
                        if key is None or key.hex()[:2] != shard or not stat.S_ISREG(st.st_mode):
                            continue
                        if remove:
                            _unlink_at(sfd, entry.name)
                        else:
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
            # Not in our index: another process may have written it since we scanned. Two lstats
            # of cached directories cost microseconds, less than a hop to a worker thread. Only a
            # regular file in a real shard folder counts (a FIFO or a link there is not a page).
            path = self.path_of(key)
            try:
                if not stat.S_ISDIR(os.lstat(path.parent).st_mode):
                    return i
                st = os.lstat(path)
            except OSError:
                return i
            if not stat.S_ISREG(st.st_mode):
                return i
            self._remember(key, st.st_size)
        return len(keys)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        places = [self._place(k) for k in keys]
        done, problem = await anyio.to_thread.run_sync(
            _read_pages, self.root, self._refused, places, into, self.settings.read_ahead
        )
        for key, io in zip(keys[:done], into[:done], strict=True):
            self._remember(key, io.nbytes)
        if problem is not None:
            self._forget(keys[done])
            if problem in _CORRUPT:
                # Not a page of ours (torn write under fsync=never, another writer's file, a FIFO or a
                # link planted there): counted; removed in the thread where that was safe.
                self.corrupt_pages += 1
                log.debug("file backend %s: page %s unusable (%s)", self.root, keys[done].hex(), problem)
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
            drop = [self._place(v) for v in victims] if w == 0 else []
            results = await anyio.to_thread.run_sync(
                _write_pages, self.root, self._refused, [self._place(keys[i]) for i in share],
                [pages[i] for i in share], fsync, drop,
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
        await anyio.to_thread.run_sync(_delete_pages, self.root, self._refused, [self._place(k) for k in keys])

    async def _clear(self) -> None:
        self._index.clear()
        await anyio.to_thread.run_sync(lambda: self._scan(remove=True))


# -- worker-thread functions (no shared state: paths and buffers in, results out) -----------------


class _Refused(Exception):
    """A shard folder is a symbolic link (or not a folder): nothing in it is read or written."""


class _Folder:
    """The tier's root and the shard folders used in one call, as descriptors, closed on exit.

    Shards are opened with ``O_NOFOLLOW`` relative to the root's descriptor, and pages relative to
    their shard's, so no path below the root is resolved through a symbolic link.
    """

    def __init__(self, root: Path, refused: set[str], *, create: bool = False) -> None:
        self.root = root
        self.refused = refused
        self.create = create
        try:
            self.fd = os.open(root, _ROOT)
        except FileNotFoundError:
            if not create:
                raise
            root.mkdir(parents=True, exist_ok=True)
            self.fd = os.open(root, _ROOT)
        self._shards: dict[str, int | None] = {}
        self._bad: set[str] = set()

    def __enter__(self) -> _Folder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for fd in self._shards.values():
            if fd is not None:
                os.close(fd)
        self._shards.clear()
        os.close(self.fd)

    def shard(self, name: str, *, create: bool = False) -> int | None:
        """The shard's descriptor; ``None`` if it does not exist (and not ``create``); ``_Refused`` if a link."""
        if name in self._bad:
            raise _Refused(name)
        fd = self._shards.get(name)
        if fd is not None or (name in self._shards and not create):
            return fd
        try:
            fd = os.open(name, _SHARD, dir_fd=self.fd)
        except FileNotFoundError:
            if not create:
                self._shards[name] = None
                return None
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass  # another writer made it (or planted something there: the open below decides)
            except OSError as exc:
                self._refuse(name, exc)
            try:
                fd = os.open(name, _SHARD, dir_fd=self.fd)
            except OSError as exc:
                self._refuse(name, exc)
        except OSError as exc:
            self._refuse(name, exc)
        self._shards[name] = fd
        return fd

    def _refuse(self, name: str, exc: OSError) -> None:
        self._bad.add(name)
        path = str(self.root / name)
        if path not in self.refused:
            self.refused.add(path)
            try:
                is_link = stat.S_ISLNK(os.lstat(name, dir_fd=self.fd).st_mode)
            except OSError:
                is_link = False
            if is_link or exc.errno == errno.ELOOP:  # O_NOFOLLOW | O_DIRECTORY on a link: ENOTDIR
                why = "a symbolic link; refusing to follow it below the tier's root"
            else:
                why = f"not a usable folder ({exc.strerror})"
            log.warning(
                "file backend: %s is %s: its pages are misses and are not written (remove it to use it again)",
                path, why,
            )
        raise _Refused(path) from exc


def _unlink_at(dir_fd: int, name: str) -> None:
    """Remove the entry ``name`` itself (a file, FIFO or link: never what a link points to)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:  # a folder in a page's place, or no right to remove it: leave it
        log.debug("file backend: cannot remove %s: %s", name, exc)


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


def _open_page(folder: _Folder, shard: str, name: str) -> int | str:
    """A descriptor of the regular file ``shard/name``, or why there is none (see ``_CORRUPT``).

    ``O_NONBLOCK``: opening a FIFO would otherwise wait for a writer, in a thread no timeout reaches.
    Whatever is not a usable regular file is removed here when that is safe (the entry itself,
    never a link's target; a folder in a page's place stays).
    """
    try:
        sfd = folder.shard(shard)
    except _Refused:
        return "refused"
    if sfd is None:
        return "missing"
    try:
        fd = os.open(name, _PAGE_READ, dir_fd=sfd)
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        # A symbolic link (ELOOP), a socket (ENXIO), a file we may not read (EACCES, EPERM): none is
        # a page we can use, and the entry itself is removed so a later store can write the page.
        _unlink_at(sfd, name)
        return {errno.ELOOP: "link", errno.ENXIO: "special"}.get(exc.errno or 0, "unreadable")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _unlink_at(sfd, name)
        return "special"
    return fd


def _read_pages(
    root: Path, refused: set[str], places: list[tuple[str, str]], into: Sequence[PageIO], read_ahead: int
) -> tuple[int, str | None]:
    """Read consecutive pages until one is missing or unusable; ``(count, problem)``.

    Every descriptor opened here is closed before it returns, whatever happens.
    """
    fds: dict[int, int | str] = {}
    n = len(places)
    try:
        with _Folder(root, refused) as folder:
            try:

                def announce(j: int) -> None:
                    got = fds[j] = _open_page(folder, *places[j])
                    if read_ahead and isinstance(got, int):
                        os.posix_fadvise(got, 0, 0, os.POSIX_FADV_WILLNEED)  # start the disk read now

                for j in range(min(max(read_ahead, 1), n)):
                    announce(j)
                for i in range(n):
                    if read_ahead and i + read_ahead < n:
                        announce(i + read_ahead)
                    elif i not in fds:
                        announce(i)
                    fd = fds.pop(i)
                    if isinstance(fd, str):
                        return i, fd
                    try:
                        expected = into[i].nbytes
                        if os.fstat(fd).st_size != expected or _preadv(fd, into[i].buffers()) != expected:
                            sfd = folder.shard(places[i][0])
                            assert sfd is not None  # the page was opened in it
                            _unlink_at(sfd, places[i][1])
                            return i, "size"
                        try:
                            os.utime(fd)  # recency survives restarts (the index is rebuilt by mtime)
                        except OSError:
                            pass  # another user's file in a shared folder: read, but not ours to touch
                    finally:
                        os.close(fd)
                return n, None
            finally:
                for fd in fds.values():
                    if isinstance(fd, int):
                        os.close(fd)
    except FileNotFoundError:
        return 0, "missing"  # no root (removed under us): nothing is stored


def _write_pages(
    root: Path, refused: set[str], places: list[tuple[str, str]], pages: Sequence[PageIO], fsync: bool,
    drop: list[tuple[str, str]],
) -> list[bool]:
    """Write each page atomically (temporary file, fsync, rename) in its shard; delete ``drop`` first."""
    results: list[bool] = []
    with _Folder(root, refused, create=True) as folder:
        _unlink_places(folder, drop)
        shards: set[int] = set()
        for (shard, name), io in zip(places, pages, strict=True):
            try:
                sfd = folder.shard(shard, create=True)
            except _Refused:
                results.append(False)
                continue
            assert sfd is not None  # created
            tmp = f".{name.removesuffix(_SUFFIX)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            try:
                fd = os.open(tmp, _PAGE_WRITE, 0o644, dir_fd=sfd)
                try:
                    _writev(fd, io.buffers())
                    if fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                # rename replaces whatever entry is there (a forged page, a FIFO, a link) itself
                os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
            except OSError as exc:
                log.warning("file backend: cannot write %s/%s: %s", shard, name, exc)
                _unlink_at(sfd, tmp)
                results.append(False)
                continue
            shards.add(sfd)
            results.append(True)
        if fsync:
            for sfd in shards:  # make the renames durable
                os.fsync(sfd)
    return results


def _unlink_places(folder: _Folder, places: list[tuple[str, str]]) -> None:
    for shard, name in places:
        try:
            sfd = folder.shard(shard)
        except _Refused:
            continue
        if sfd is not None:
            _unlink_at(sfd, name)


def _delete_pages(root: Path, refused: set[str], places: list[tuple[str, str]]) -> None:
    try:
        with _Folder(root, refused) as folder:
            _unlink_places(folder, places)
    except FileNotFoundError:
        pass  # no root: nothing to delete
