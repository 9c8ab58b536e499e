"""Page files in a folder others may write to: the file tier's worker-thread I/O.

Everything here runs in worker threads, with no shared state (paths and buffers in, results out).
Nothing below the tier's root is reached through a symbolic link: shard folders are opened with
``O_NOFOLLOW`` relative to the root's descriptor, and page files relative to their shard's
(``dir_fd``), opened with ``O_NONBLOCK | O_NOFOLLOW`` and used only if ``fstat`` says they are regular
files. Every descriptor opened here is closed before the call returns.

With ``direct``, page files are written and read with ``O_DIRECT`` through each thread's aligned
bounce buffer (the payload starts 128 bytes into a file, so it cannot go straight from the host
page): no page-cache page is allocated. On a virtual machine whose free memory is handed back to
its host (free page reporting, a balloon), every new page-cache page costs a fault in the host: a
buffered write of a 5.6 MiB page took 13.5-14.4 ms of CPU here, ``O_DIRECT`` with the copy into the
bounce buffer 3.5 ms. A file system that takes no ``O_DIRECT`` is written and read buffered (logged once).

What is created here gets its permission bits from ``Modes``, whatever the process's umask: by
default (``PRIVATE``) folders ``0700`` and page files ``0600``, so no other user reads a page (with a
tenant key the payload is only authenticated, not encrypted); ``GROUP`` (``share: group``) folders
``2770`` (new entries take the folder's group) and files ``0660``, for a folder shared on purpose.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .base import PageIO, fits

__all__ = [
    "CORRUPT", "GROUP", "PRIVATE", "SUFFIX", "Folder", "Modes", "Refused", "delete_pages", "open_page", "read_pages",
    "unlink_at", "write_pages",
]

log = logging.getLogger("hicache.tiers.storage.file")

SUFFIX = ".kv"
#: Why a page was not read: "missing" is a plain miss, every other reason a corrupt page.
CORRUPT = frozenset({"size", "special", "link", "unreadable", "refused"})
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_PAGE_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | _CLOEXEC
_PAGE_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC
_SHARD = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
_ROOT = os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC


@dataclass(frozen=True)
class Modes:
    """Permission bits of the folders and page files the tier creates (never of those it finds)."""

    folder: int
    file: int

    @property
    def chmod_files(self) -> bool:
        """Whether each new page file needs an ``fchmod``: a usual umask (``022``) takes group bits
        away from the ``open`` mode; it can only take bits from ``0600``, never add any."""
        return bool(self.file & 0o077)


PRIVATE = Modes(folder=0o700, file=0o600)
GROUP = Modes(folder=0o2770, file=0o660)


def _set_mode(fd: int, mode: int) -> None:
    """``fchmod`` a folder or file this process just created (a folder another writer made in the
    meantime may not be ours to change: left as it is)."""
    try:
        os.fchmod(fd, mode)
    except PermissionError:
        pass


class Refused(Exception):
    """A shard folder is a symbolic link (or not a folder): nothing in it is read or written."""


class Folder:
    """The tier's root and the shard folders used in one call, as descriptors, closed on exit.

    Shards are opened with ``O_NOFOLLOW`` relative to the root's descriptor, and pages relative to
    their shard's, so no path below the root is resolved through a symbolic link.
    """

    def __init__(self, root: Path, refused: set[str], *, create: bool = False, modes: Modes = PRIVATE) -> None:
        self.root = root
        self.refused = refused
        self.create = create
        self.modes = modes
        try:
            self.fd = os.open(root, _ROOT)
        except FileNotFoundError:
            if not create:
                raise
            root.parent.mkdir(parents=True, exist_ok=True)  # the folders above: as `mkdir -p` makes them
            try:
                os.mkdir(root, modes.folder & 0o777)
                made = True
            except FileExistsError:
                made = False  # another process made it meanwhile: its modes stay
            self.fd = os.open(root, _ROOT)
            if made:
                _set_mode(self.fd, modes.folder)
        self._shards: dict[str, int | None] = {}
        self._bad: set[str] = set()

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for fd in self._shards.values():
            if fd is not None:
                os.close(fd)
        self._shards.clear()
        os.close(self.fd)

    def shard(self, name: str, *, create: bool = False) -> int | None:
        """The shard's descriptor; ``None`` if it does not exist (and not ``create``); ``Refused`` if a link."""
        if name in self._bad:
            raise Refused(name)
        fd = self._shards.get(name)
        if fd is not None or (name in self._shards and not create):
            return fd
        try:
            fd = os.open(name, _SHARD, dir_fd=self.fd)
        except FileNotFoundError:
            if not create:
                self._shards[name] = None
                return None
            made = False
            try:
                os.mkdir(name, self.modes.folder & 0o777, dir_fd=self.fd)
                made = True
            except FileExistsError:
                pass  # another writer made it (or planted something there: the open below decides)
            except OSError as exc:
                self._refuse(name, exc)
            try:
                fd = os.open(name, _SHARD, dir_fd=self.fd)
            except OSError as exc:
                self._refuse(name, exc)
            if made:
                _set_mode(fd, self.modes.folder)
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
        raise Refused(path) from exc


def unlink_at(dir_fd: int, name: str) -> None:
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


# -- O_DIRECT ------------------------------------------------------------------------------------

_DIRECT_ALIGN = 4096  # file offsets, lengths and memory: a multiple of any logical block size
_bounce = threading.local()
_no_direct: set[int] = set()  # devices (st_dev) whose file system refused O_DIRECT (logged once each)


def _round_up(n: int) -> int:
    return -(-n // _DIRECT_ALIGN) * _DIRECT_ALIGN


def _bounce_buffer(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer of ``nbytes`` (a multiple of the alignment), kept for its
    next call, so its memory stays resident (fresh memory is what ``O_DIRECT`` avoids paying for)."""
    buf = getattr(_bounce, "buf", None)
    if buf is None or len(buf) < nbytes:
        buf = _bounce.buf = mmap.mmap(-1, nbytes)
    return memoryview(buf)[:nbytes]


def _set_direct(fd: int) -> bool:
    """Turn ``O_DIRECT`` on for ``fd``; ``False`` where its file system takes none (logged once)."""
    if os.fstat(fd).st_dev in _no_direct:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _refuse_direct(fd)
        return False
    return True


def _refuse_direct(fd: int) -> None:
    """``fd``'s file system refused ``O_DIRECT`` (when set, or on a transfer: an alignment larger
    than ours): this file and the later ones on its device go buffered."""
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
    dev = os.fstat(fd).st_dev
    if dev not in _no_direct:
        _no_direct.add(dev)
        log.warning("file backend: this file system takes no O_DIRECT; direct_io pages are written and read buffered")


def _write_direct(fd: int, pieces: list[memoryview]) -> bool:
    """Write ``pieces`` from the file's start with ``O_DIRECT``; ``False``: nothing written (no O_DIRECT here)."""
    if not _set_direct(fd):
        return False
    size = sum(b.nbytes for b in pieces)
    padded = _round_up(size)
    bounce = _bounce_buffer(padded)
    dst = np.frombuffer(bounce, dtype=np.uint8)
    at = 0
    for b in pieces:
        dst[at : at + b.nbytes] = np.frombuffer(b, dtype=np.uint8)  # numpy copies without the GIL
        at += b.nbytes
    dst[at:] = 0
    try:
        written = os.pwrite(fd, bounce, 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _refuse_direct(fd)  # nothing was written: the caller writes it buffered
        return False
    if written != padded:
        raise OSError("short write")
    os.ftruncate(fd, size)  # the padding goes: the file is the page, byte for byte
    return True


def _read_direct(fd: int, size: int, pieces: list[memoryview]) -> int | None:
    """Read the file (``size`` bytes, as ``fstat`` said) with ``O_DIRECT`` into ``pieces`` in order;
    bytes the file held (up to the padding; ``None``: no O_DIRECT here, nothing read)."""
    if not _set_direct(fd):
        return None
    bounce = _bounce_buffer(_round_up(size + 1))  # one byte more: a file grown since fstat shows
    try:
        got = os.preadv(fd, [bounce], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        _refuse_direct(fd)
        return None
    src = np.frombuffer(bounce, dtype=np.uint8, count=got)
    at = 0
    for b in pieces:
        n = min(b.nbytes, got - at)
        if n <= 0:
            break
        np.frombuffer(b, dtype=np.uint8)[:n] = src[at : at + n]
        at += n
    return got


def open_page(folder: Folder, shard: str, name: str, tidy: bool = True) -> int | str:
    """A descriptor of the regular file ``shard/name``, or why there is none (see ``_CORRUPT``).

    ``O_NONBLOCK``: opening a FIFO would otherwise wait for a writer, in a thread no timeout reaches.
    With ``tidy``, whatever is not a usable regular file is removed here when that is safe (the
    entry itself, never a link's target; a folder in a page's place stays).
    """
    try:
        sfd = folder.shard(shard)
    except Refused:
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
        if tidy:
            unlink_at(sfd, name)
        return {errno.ELOOP: "link", errno.ENXIO: "special"}.get(exc.errno or 0, "unreadable")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        if tidy:
            unlink_at(sfd, name)
        return "special"
    return fd


def read_pages(
    root: Path, refused: set[str], places: list[tuple[str, str]], into: Sequence[PageIO], read_ahead: int,
    touch: bool = True,
    sizes: list[int] | None = None,
    direct: bool = False,
) -> tuple[int, str | None]:
    """Read consecutive pages until one is missing or unusable; ``(count, problem)``.

    ``touch``: the cache's read, which refreshes each page's mtime and removes an unusable entry;
    without it a reader's (``hicache inspect``), which changes nothing. With ``sizes``, pages vary
    in size (``StorageBackend.get``): each fills its buffers from the start and its size is
    recorded. With ``direct``, each file is read with ``O_DIRECT`` (no page cache, so nothing is
    announced ahead). Every descriptor opened here is closed before it returns, whatever happens.
    """
    fds: dict[int, int | str] = {}
    n = len(places)
    try:
        with Folder(root, refused) as folder:
            try:

                def announce(j: int) -> None:
                    got = fds[j] = open_page(folder, *places[j], tidy=touch)
                    if read_ahead and not direct and isinstance(got, int):
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
                        size = os.fstat(fd).st_size
                        got = None
                        if fits(size, into[i].nbytes, sizes):
                            got = _read_direct(fd, size, into[i].buffers()) if direct else None
                            if got is None:
                                got = _preadv(fd, into[i].buffers())
                        if got != size:
                            sfd = folder.shard(places[i][0])
                            assert sfd is not None  # the page was opened in it
                            if touch:
                                unlink_at(sfd, places[i][1])
                            return i, "size"
                        if sizes is not None:
                            sizes[i] = size
                        if into[i].landed is not None:
                            into[i].landed()  # the tier checks it on its codec threads while we read on
                        if touch:
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


def write_pages(
    root: Path, refused: set[str], places: list[tuple[str, str]], pages: Sequence[PageIO], fsync: bool,
    drop: list[tuple[str, str]], write_batch: Callable[[list[tuple[int, PageIO]]], None] | None = None,
    direct: bool = False, modes: Modes = PRIVATE,
) -> list[bool]:
    """Write each page atomically (an unnamed file linked into place, or a temporary file renamed;
    fsynced before, with its folder after, under ``fsync``) in its shard; delete ``drop`` first.
    A page with a ``seal`` gets its header from it here, just before it is written.

    ``write_batch`` (``kind: nixl``): writes every ``(descriptor, page)`` of the call in one go, or
    raises (then none of them is named); by default each page is written with ``writev`` as it is
    opened (with ``O_DIRECT`` under ``direct``). Either way a page gets its name only once all of it
    is in its file. Folders and files created get ``modes``.
    """
    results = [False] * len(places)
    with Folder(root, refused, create=True, modes=modes) as folder:
        _unlink_places(folder, drop)
        shards: set[int] = set()
        opened: list[tuple[int, int, int, str | None]] = []  # (page, shard fd, file fd, temporary name)
        try:
            for i, (shard, name) in enumerate(places):
                try:
                    sfd = folder.shard(shard, create=True)
                except Refused:
                    continue
                assert sfd is not None  # created
                try:
                    fd, tmp = _open_target(sfd, name, modes)
                except OSError as exc:
                    log.warning("file backend: cannot write %s/%s: %s", shard, name, exc)
                    continue
                opened.append((i, sfd, fd, tmp))
                if write_batch is None:
                    _settle(
                        opened.pop(), places, pages, fsync, results, shards, write=True, direct=direct, modes=modes
                    )
            if write_batch is not None and opened:
                try:
                    for i, _sfd, _fd, _tmp in opened:
                        if pages[i].seal is not None:
                            pages[i].seal()
                    write_batch([(fd, pages[i]) for i, _sfd, fd, _tmp in opened])
                except OSError as exc:
                    log.warning("file backend: a batch of %d pages could not be written: %s", len(opened), exc)
                else:
                    while opened:
                        _settle(opened.pop(), places, pages, fsync, results, shards, write=False, modes=modes)
        finally:
            for _i, sfd, fd, tmp in opened:  # not named: nothing of them stays
                os.close(fd)
                if tmp is not None:
                    unlink_at(sfd, tmp)
        if fsync:
            for sfd in shards:  # make the renames durable
                os.fsync(sfd)
    return results


# Whether this file system takes O_TMPFILE and /proc/self/fd links (checked on the first write).
_anonymous = [hasattr(os, "O_TMPFILE")]
_NO_TMPFILE = {errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT, errno.EXDEV}


def _tmp_name(name: str) -> str:
    return f".{name.removesuffix(SUFFIX)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"


def _new_file(path: str, flags: int, sfd: int, modes: Modes) -> int:
    """``open`` a new file with ``modes.file`` (set with ``fchmod`` where the umask may have cut it)."""
    fd = os.open(path, flags, modes.file, dir_fd=sfd)
    if modes.chmod_files:
        try:
            os.fchmod(fd, modes.file)
        except OSError:
            os.close(fd)
            raise
    return fd


def _open_target(sfd: int, name: str, modes: Modes = PRIVATE) -> tuple[int, str | None]:
    """A new file to write page ``name`` into: without a name (``O_TMPFILE``, ``None``) where the
    file system takes it, else under a temporary name in the shard."""
    if _anonymous[0]:
        try:
            return _new_file(".", os.O_WRONLY | os.O_TMPFILE | _CLOEXEC, sfd, modes), None
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
            _anonymous[0] = False
    tmp = _tmp_name(name)
    return _new_file(tmp, _PAGE_WRITE, sfd, modes), tmp


def _settle(
    target: tuple[int, int, int, str | None], places: list[tuple[str, str]], pages: Sequence[PageIO], fsync: bool,
    results: list[bool], shards: set[int], *, write: bool, direct: bool = False, modes: Modes = PRIVATE,
) -> None:
    """Write (with ``write``), fsync (under ``fsync``) and name one opened page; its descriptor is closed."""
    i, sfd, fd, tmp = target
    shard, name = places[i]
    try:
        try:
            if write:
                if pages[i].seal is not None:
                    pages[i].seal()  # its header (checksum or MAC), from the bytes about to be written
                _write(fd, pages[i].buffers(), direct)
            if fsync:
                os.fsync(fd)
            named = _give_name(sfd, fd, tmp, name)
        finally:
            os.close(fd)
        if not named:  # no /proc to link an unnamed file from: the rename path from now on
            _write_renamed(sfd, name, pages[i], fsync, direct, modes)
    except OSError as exc:
        if tmp is not None:
            unlink_at(sfd, tmp)
        log.warning("file backend: cannot write %s/%s: %s", shard, name, exc)
        return
    shards.add(sfd)
    results[i] = True


def _give_name(sfd: int, fd: int, tmp: str | None, name: str) -> bool:
    """Give the written file its page's name in one step; ``False``: the file system cannot link an
    unnamed file (nothing was named).

    An unnamed file gets it in one ``linkat``: the name appears only for the whole page, as with a
    rename, and a new page costs one directory entry instead of a temporary one created and renamed.
    A name already taken (the page rewritten, or something planted there) goes through a temporary
    name and a rename, which replaces the entry itself (a forged page, a FIFO or a link).
    """
    if tmp is not None:
        os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
        return True
    source = f"/proc/self/fd/{fd}"
    try:
        os.link(source, name, dst_dir_fd=sfd, follow_symlinks=True)
    except FileExistsError:
        tmp = _tmp_name(name)
        os.link(source, tmp, dst_dir_fd=sfd, follow_symlinks=True)
        try:
            os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
        except OSError:
            unlink_at(sfd, tmp)
            raise
    except OSError as exc:
        if exc.errno not in _NO_TMPFILE:
            raise
        _anonymous[0] = False
        return False
    return True


def _write(fd: int, pieces: list[memoryview], direct: bool) -> None:
    if not (direct and _write_direct(fd, pieces)):
        _writev(fd, pieces)


def _write_renamed(
    sfd: int, name: str, io: PageIO, fsync: bool, direct: bool = False, modes: Modes = PRIVATE
) -> None:
    """Write the page to a temporary file and rename it over ``name`` (which replaces whatever entry
    is there, a forged page, a FIFO or a link, itself)."""
    tmp = _tmp_name(name)
    try:
        fd = _new_file(tmp, _PAGE_WRITE, sfd, modes)
        try:
            _write(fd, io.buffers(), direct)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=sfd, dst_dir_fd=sfd)
    except OSError:
        unlink_at(sfd, tmp)
        raise


def _unlink_places(folder: Folder, places: list[tuple[str, str]]) -> None:
    for shard, name in places:
        try:
            sfd = folder.shard(shard)
        except Refused:
            continue
        if sfd is not None:
            unlink_at(sfd, name)


def delete_pages(root: Path, refused: set[str], places: list[tuple[str, str]]) -> None:
    try:
        with Folder(root, refused) as folder:
            _unlink_places(folder, places)
    except FileNotFoundError:
        pass  # no root: nothing to delete
