"""``kind: file``: one file per page in a sharded directory, shared safely by processes and restarts.

Layout: ``<path>/<first two hex digits of the key>/<32 hex digits>.kv``, each file a canonical page
(header + payload). File names come only from page keys, never from user input.

* **Atomic writes**: a page is written to a temporary file in its shard, optionally fsynced, then
  renamed over the final name, so readers (this process or another) see a whole page or none. Two
  processes writing the same page both produce a valid file; the last rename wins.
* **fsync policy**: ``never`` (the default: atomic but not durable; a page torn by a power loss
  fails its checksum and is a miss, never wrong data) or ``always`` (file data before the rename,
  the shard directory after: the page survives a power loss once ``set`` returns). A cache can
  recompute what a power loss takes, and fsync is most of the write path's time: on the benchmark
  trace 7-8 ms per call, two per page (75% of the writer threads' time), and one store's backup and
  writes take 32 ms with it against 21 ms without (``benchmarks/background_cost.py``, docs/storage.md).
* **Capacity**: bytes of page files this process knows of; the least recently used files are
  deleted to make room. Reads refresh a file's mtime, so recency survives restarts (not those of
  ``hicache inspect``, which opens the tier with ``touch_on_read: false``).
* **Restarts and other processes**: the index is rebuilt from the directory at ``open`` (oldest
  mtime first). It is a hint for capacity, never the answer to ``exists``, which asks the folder
  for every key: pages written by another process since are found, and pages another process
  removed (its eviction, ``hicache inspect purge``) or a folder unusable for a while lost are not
  taken as held, so a write that skips "held" pages never skips a missing one. Several processes
  may share a directory; each enforces ``capacity`` on what it knows, so their total may exceed it
  briefly.
* **Who may read it** (``share``): what the tier creates is its user's alone (folders 0700, page
  files 0600), whatever the umask, or with ``share: group`` its folder's group's too (2770, 0660).
  A tenant key authenticates pages, it does not encrypt them: only ``aes-gcm`` keeps the KV from
  whoever can read the files.

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

import logging
import os
import re
import stat
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

import anyio
from pydantic import Field, ValidationInfo, field_validator

from ...config import ByteSize
from ...errors import ConfigError
from .base import BackendSettings, PageIO, StorageBackend, StoredPage, settings_environ
from .lru_index import LruIndex
from .page_files import (
    CORRUPT, GROUP, PRIVATE, SUFFIX, Folder, Refused, delete_pages, read_pages, unlink_at, write_pages,
)
from .page_format import HEADER_BYTES

__all__ = ["FileBackend"]

log = logging.getLogger(__name__)

_SUFFIX = SUFFIX
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
_STALE_TMP_S = 15 * 60  # a temporary file this old belongs to a writer that died
_PAGE_READ_ONLY = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_VAR = re.compile(r"\$(?P<name>[A-Za-z_][A-Za-z0-9_]*)")  # $VAR; ${VAR} is load_config's (strict there)


def expand_path(path: str, environ: Mapping[str, str] = os.environ) -> Path:
    """``~`` and ``$VAR`` (from ``environ``) expanded; ``ValueError`` naming a variable that is not set.

    ``${VAR}`` is expanded (strictly) by ``load_config``; what reaches here in that form was written
    ``$${VAR}`` there, a literal. ``os.path.expandvars`` would leave an unset ``$VAR`` as it is, and
    a folder named ``$VAR`` would appear. An entry sent to the admin endpoint is expanded from no
    environment (``settings_environ``): any ``$VAR`` in it is an error, ``~`` the one thing expanded.
    """

    def value(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in environ:
            if environ is os.environ:
                raise ValueError(
                    f"environment variable {name} in path {path!r} is not set: set it, or write the path out"
                )
            raise ValueError(
                f"path {path!r} names the environment variable {name}, and an entry sent to the admin endpoint is "
                "expanded from no environment: write the path out (`hicache admin attach` expands ${VAR} from "
                "your shell)"
            )
        return environ[name]

    return Path(_VAR.sub(value, path)).expanduser()


def shown_path(path: str, where: Path) -> str:
    """How a message names the folder: as written when a variable is in it (its value may be a
    secret, and no message shows what a variable holds), else as expanded."""
    return repr(path) if _VAR.search(path) else repr(str(where))


class FileBackend(StorageBackend):
    kind = "file"
    max_batch = 64
    can_list = True
    variable_size_pages = True
    seals_pages = True  # page_files.write_pages seals each page in the writer thread that writes it

    class Settings(BackendSettings):
        path: str = Field(min_length=1)
        capacity: ByteSize = 10 * 1024**3
        fsync: Literal["always", "never"] = "never"  # pages are checksummed and renamed into place
        write_threads: int = Field(default=8, ge=1, le=64, strict=True)
        read_ahead: int = Field(default=64, ge=0, le=256, strict=True)
        #: ``O_DIRECT`` page files (``page_files.py``): no page cache, so no fresh page-cache memory
        #: to fault in (on a VM that hands free memory back to its host, most of a buffered write's
        #: cost), and no hidden second copy of pages the host tier already keeps; reads then come
        #: from the disk every time.
        direct_io: bool = False
        #: Reads refresh each page file's mtime (the recency eviction and restarts go by) and remove
        #: an unusable entry. ``hicache inspect`` reads with ``false``: a reader that changes nothing.
        touch_on_read: bool = True
        #: Who may read and write what the tier creates (``page_files.Modes``), whatever the umask:
        #: ``private``, this user only (folders 0700, page files 0600); ``group``, the folder's group
        #: too (folders 2770, files 0660), for a folder several users' caches share on purpose.
        share: Literal["private", "group"] = "private"

        @field_validator("path")
        @classmethod
        def _usable_path(cls, path: str, info: ValidationInfo) -> str:
            where = expand_path(path, settings_environ(info))
            if where.exists() and not where.is_dir():
                raise ValueError(
                    f"{shown_path(path, where)} is a file, not a folder: point `path` at a folder (created if missing)"
                )
            return path

    settings: Settings
    #: Writes a batch of opened page files in one go (``page_files.write_pages``); ``kind: nixl`` sets it.
    _write_batch: Callable[[list[tuple[int, PageIO]]], None] | None = None

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self.root = expand_path(self.settings.path)
        self._shown = shown_path(self.settings.path, self.root)  # the folder, as messages name it
        self._index = LruIndex(self.settings.capacity)  # key -> file size, least recently used first
        self._write_limiter = anyio.CapacityLimiter(self.settings.write_threads)
        self._refused: set[str] = set()  # shard folders already reported as links (logged once each)
        self._modes = GROUP if self.settings.share == "group" else PRIVATE

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
            raise ConfigError(  # strerror only: str(exc) would name the expanded path
                f"file tier: cannot use {self._shown} as its folder ({exc.strerror or type(exc).__name__}): set "
                "`path` to a folder this process can create, read and write"
            ) from None
        self._warn_if_open_to_others()
        found.sort(key=lambda item: item[2])
        self._index.clear()
        for key, size, _ in found:  # oldest first
            self._index.remember(key, size)
        log.debug("file backend %s: %d pages, %d bytes", self._shown, len(self._index), self._index.used)

    def _warn_if_open_to_others(self) -> None:
        """A folder that was there before (the tier makes its own ``0700``, or ``2770`` shared by a
        group) and lets more users in than ``share`` says: said once, left as it is (it is yours)."""
        try:
            mode = os.stat(self.root).st_mode
        except OSError:
            return
        wider = mode & (0o077 if self._modes is PRIVATE else 0o007)
        if wider:
            log.warning(
                "file backend %s: the folder's mode is %o, wider than `share: %s` (pages are written %o, folders "
                "this tier makes %o): other users may reach pages written before; `chmod %s` the folder",
                self._shown, stat.S_IMODE(mode), self.settings.share, self._modes.file, self._modes.folder,
                "700" if self._modes is PRIVATE else "o-rwx",
            )

    def _scan(self, remove: bool = False) -> list[tuple[bytes, int, float]]:
        """Every page file under the root as ``(key, size, mtime)``; stale temporaries removed.

        With ``remove``, page files and temporaries are deleted instead (``clear``).
        """
        found: list[tuple[bytes, int, float]] = []
        now = time.time()
        with Folder(self.root, self._refused, create=True, modes=self._modes) as folder:
            with os.scandir(folder.fd) as shards:
                names = [s.name for s in shards if len(s.name) == 2]
            for shard in names:
                try:
                    sfd = folder.shard(shard)
                except Refused:
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
                                unlink_at(sfd, entry.name)
                            continue
                        key = self._key_of(entry.name)
                        if key is None or key.hex()[:2] != shard or not stat.S_ISREG(st.st_mode):
                            continue
                        if remove:
                            unlink_at(sfd, entry.name)
                        else:
                            found.append((key, st.st_size, st.st_mtime))
        return found

    def _usage(self) -> tuple[int, int, int]:
        return self._index.used, self.settings.capacity, len(self._index)

    # -- listing (hicache inspect) --------------------------------------------------------------

    @classmethod
    def inspection_options(cls, options: dict[str, object]) -> dict[str, object]:
        """A reader leaves each page's mtime (the last use ``summary`` and ``purge --older-than`` go
        by) and the folder as they are."""
        return {**options, "touch_on_read": False}

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        """One batch per shard folder, each listed in a worker thread; nothing is followed or changed.

        An entry with a page's name that is not a regular file (a link, a FIFO) is listed with no
        size, so ``inspect verify`` reports it and ``--repair`` removes the entry itself.
        """
        shards = await anyio.to_thread.run_sync(self._shard_names)
        for shard in shards:
            batch = await anyio.to_thread.run_sync(self._list_shard, shard)
            if batch:
                yield batch

    def _shard_names(self) -> list[str]:
        try:
            with Folder(self.root, self._refused) as folder, os.scandir(folder.fd) as shards:
                return sorted(s.name for s in shards if len(s.name) == 2)
        except FileNotFoundError:
            return []

    def _list_shard(self, shard: str) -> list[StoredPage]:
        out: list[StoredPage] = []
        with Folder(self.root, self._refused) as folder:
            try:
                sfd = folder.shard(shard)
            except Refused:
                return out
            if sfd is None:
                return out
            with os.scandir(sfd) as entries:
                for entry in entries:
                    key = self._key_of(entry.name)
                    if key is None or key.hex()[:2] != shard:
                        continue
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    regular = stat.S_ISREG(st.st_mode)
                    out.append(StoredPage(key, st.st_size if regular else None, st.st_mtime if regular else None))
        return out

    async def _read_headers(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        return await self._call("get", anyio.to_thread.run_sync, self._headers_sync, [p.key for p in pages])

    def _headers_sync(self, keys: list[bytes]) -> list[bytes | None]:
        """The first bytes of each page file, read-only: regular files only, never through a link."""
        out: list[bytes | None] = []
        with Folder(self.root, self._refused) as folder:
            for key in keys:
                shard, name = self._place(key)
                try:
                    sfd = folder.shard(shard)
                except Refused:
                    sfd = None
                header = None
                if sfd is not None:
                    try:
                        fd = os.open(name, _PAGE_READ_ONLY, dir_fd=sfd)
                    except OSError:
                        fd = -1
                    if fd >= 0:
                        try:
                            if stat.S_ISREG(os.fstat(fd).st_mode):
                                data = os.pread(fd, HEADER_BYTES, 0)
                                header = data if len(data) == HEADER_BYTES else None
                        finally:
                            os.close(fd)
                out.append(header)
        return out

    # -- index ----------------------------------------------------------------------------------

    def _remember(self, key: bytes, size: int) -> None:
        self._index.remember(key, size)

    def _forget(self, key: bytes) -> None:
        self._index.forget(key)
        self._removed((key,))

    # -- the three operations -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        """Pages whose file is there now, asked of the folder for every key: the index is only a
        hint. Callers skip writing what this says is held (``StorageWriter``, SGLang's ``store``),
        and the index can be stale: another process evicted or purged the files, or the folder
        was unusable and came back empty. Two ``lstat``s of cached folders: ~2.5 us a page here
        (0.27 us when the index answered alone), small beside reading a page and no reason for a
        hop to a worker thread. Only a regular file in a real shard folder counts (a FIFO or
        a link there is not a page); a page the index knew and the folder lost is forgotten."""
        root = str(self.root)
        for i, key in enumerate(keys):
            name = key.hex()
            shard = f"{root}/{name[:2]}"
            try:
                if not stat.S_ISDIR(os.lstat(shard).st_mode):
                    st = None
                else:
                    st = os.lstat(f"{shard}/{name}{_SUFFIX}")
            except OSError:
                st = None
            if st is None or not stat.S_ISREG(st.st_mode):
                if st is not None and key in self._index:
                    await self._unusable(key)  # a page we knew became a FIFO, a link, a folder
                self._forget(key)
                return i
            if key not in self._index:  # another process wrote it since we scanned
                self._remember(key, st.st_size)
        return len(keys)

    async def _unusable(self, key: bytes) -> None:
        """Something that is not a page file sits where a page we knew was: a corrupt page, counted
        and (as a read would) removed, the entry itself, through its shard's descriptor."""
        self.corrupt_pages += 1
        log.debug("file backend %s: page %s replaced by something not a regular file", self._shown, key.hex())
        if self.settings.touch_on_read:
            await anyio.to_thread.run_sync(delete_pages, self.root, self._refused, [self._place(key)])

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await self._read(keys, into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await self._read(keys, into, sizes)

    async def _read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        places = [self._place(k) for k in keys]
        done, problem = await anyio.to_thread.run_sync(
            read_pages, self.root, self._refused, places, into, self.settings.read_ahead,
            self.settings.touch_on_read, sizes, self.settings.direct_io,
        )
        for i, (key, io) in enumerate(zip(keys[:done], into[:done], strict=True)):
            self._remember(key, io.nbytes if sizes is None else sizes[i])
        if problem is not None:
            self._forget(keys[done])
            if problem in CORRUPT:
                # Not a page of ours (torn write under fsync=never, another writer's file, a FIFO or a
                # link planted there): counted; removed in the thread where that was safe.
                self.corrupt_pages += 1
                log.debug("file backend %s: page %s unusable (%s)", self._shown, keys[done].hex(), problem)
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
        fsync = self.settings.fsync == "always"
        # With fsync, threads wait on the disk (and share journal commits): write_threads of them.
        # Without, writing is CPU work (sealing each page, copying it into the page cache): more
        # threads than cores only take turns, so one per core at most.
        workers = min(self.settings.write_threads, len(keys), self.settings.write_threads if fsync else _CORES)

        async def write_share(w: int) -> None:
            share = list(range(w, len(keys), workers))
            drop = [self._place(v) for v in victims] if w == 0 else []
            results = await anyio.to_thread.run_sync(
                write_pages, self.root, self._refused, [self._place(keys[i]) for i in share],
                [pages[i] for i in share], fsync, drop, self._write_batch, self.settings.direct_io,
                self._modes, limiter=self._write_limiter,
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
        await anyio.to_thread.run_sync(delete_pages, self.root, self._refused, [self._place(k) for k in keys])

    async def _clear(self) -> None:
        self._index.clear()
        await anyio.to_thread.run_sync(lambda: self._scan(remove=True))
