"""The side channel from vLLM's scheduler to the worker that owns the cache: a Unix socket.

vLLM runs its scheduler and its worker in different processes by default (on CPU: the engine
core and one worker process). hicache's index, host pool and prefetches live with the worker,
next to vLLM's KV tensors; the scheduler must still answer, synchronously, how many tokens of a
request hicache holds. It asks the worker over this socket (one round trip, about 0.1-0.3 ms
here), so the answer comes from the one index that also knows the host tier and the prefetches in
flight, and the lookup made when a request is queued starts its storage prefetch in the process
that will load it. Single-process vLLM uses the same path (the worker serves from its event loop
thread), so there is one code path to test.

Frames are a 4-byte big-endian length and a JSON object. A lookup's token ids travel as one
string, the base64 of their little-endian int64 bytes (``pack_tokens``), which the worker hands
to the cache as a tensor over those bytes: for a 1,500-token prompt about 65 us from the
scheduler's list to the cache's key bytes, against 175 us through a JSON list of numbers (a list
is still accepted). The socket is named after a digest of vLLM's engine id, which both
processes share, in a folder of this user's that nobody else can enter (``runtime_dir``):

* ``$HICACHE_VLLM_RUNTIME_DIR`` when set (the operator's choice: a link, another owner or a
  folder others may write to is an error);
* else ``$XDG_RUNTIME_DIR/hicache-vllm`` when that runtime folder is this user's and private;
* else ``hicache-vllm-<uid>`` in the temp dir. Its name is predictable, so another local user may
  have made it first (a link, dangling or to a folder of theirs, or a folder they own or can
  write): it is created without ``exist_ok`` and checked with ``lstat`` (a real folder, owned by
  this user, mode 0700), never followed; if it is not that, the sockets go to a folder of a random
  name (``tempfile.mkdtemp``, ``hicache-vllm-<uid>-*``), and a client that finds no socket in its
  own such folder looks for it in this user's other private ``hicache-vllm-<uid>-*`` folders,
  so the scheduler still finds the worker that listens in one. Only this user can create an entry
  in them, so a socket found there is this user's.

Every wait is bounded; a failed or slow answer is a miss (the request is computed), never an
engine error.
"""

from __future__ import annotations

import base64
import atexit
import hashlib
import json
import logging
import os
import socket
import stat
import struct
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Any

__all__ = ["socket_path", "runtime_dir", "ChannelClient", "encode", "pack_tokens", "unpack_tokens", "MAX_FRAME"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

MAX_FRAME = 64 << 20  # a lookup of 1M tokens is ~8 MB of JSON
_HEADER = struct.Struct(">I")


_NAME = "hicache-vllm"
_fallback: Path | None = None  # this process's random folder, once the predictable one was found planted


def _ours(path: Path, *, private: bool) -> bool:
    """Whether ``path`` itself (never what a link points to) is a folder of this user's that others
    cannot write to (``private``: cannot enter or list either: no group or other bits at all)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    closed = 0o077 if private else stat.S_IWGRP | stat.S_IWOTH
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & closed


def _private(path: Path) -> bool:
    """Make ``path`` a private folder (0700), or take it if it is one of this user's already; False
    when something else holds the name (a link, another owner, a folder open to others)."""
    try:
        os.mkdir(path, 0o700)  # no exist_ok: what is there already is checked, never trusted
    except FileExistsError:
        pass
    except OSError:
        return False
    return _ours(path, private=True)


def _fallbacks(tmp: Path) -> list[Path]:
    """This user's private random-named folders in ``tmp`` (``hicache-vllm-<uid>-*``), oldest name first."""
    prefix = f"{_NAME}-{os.getuid()}-"
    try:
        with os.scandir(tmp) as entries:
            names = sorted(e.name for e in entries if e.name.startswith(prefix))
    except OSError:
        return []
    return [tmp / n for n in names if _ours(tmp / n, private=True)]


def _fallback_dir(tmp: Path, planted: Path) -> Path:
    global _fallback
    if _fallback is not None and _ours(_fallback, private=True):
        return _fallback
    found = _fallbacks(tmp)
    if found:
        _fallback = found[0]  # most likely the one the engine's other processes chose
    else:
        _fallback = Path(tempfile.mkdtemp(prefix=f"{_NAME}-{os.getuid()}-", dir=tmp))
        atexit.register(_remove_if_empty, _fallback)
    log.warning(
        "hicache: %s is not a private folder of this user (a link, another owner, or open to others: made by "
        "someone else?); it is left alone and the worker channel's sockets go to %s", planted, _fallback,
    )
    return _fallback


def _remove_if_empty(path: Path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def runtime_dir() -> Path:
    """The folder of this user's channel sockets (see the module docstring), created if needed."""
    explicit = os.environ.get("HICACHE_VLLM_RUNTIME_DIR")
    if explicit:
        path = Path(explicit)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        if not _ours(path, private=False):
            raise PermissionError(
                f"HICACHE_VLLM_RUNTIME_DIR={path} must be a folder (not a link) owned by this user and not "
                "writable by others"
            )
        return path
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isabs(xdg) and _ours(Path(xdg), private=True) and _private(Path(xdg) / _NAME):
        return Path(xdg) / _NAME
    tmp = Path(tempfile.gettempdir())
    path = tmp / f"{_NAME}-{os.getuid()}"
    if _private(path):
        return path
    return _fallback_dir(tmp, path)


def socket_path(engine_id: str, rank: int = 0) -> str:
    """Where worker ``rank`` (its TP rank) of vLLM engine ``engine_id`` listens (the same in every
    process of the engine). Rank 0's name is the one a single-rank engine always had."""
    name = engine_id if rank == 0 else f"{engine_id}\0rank{rank}"
    digest = hashlib.blake2b(name.encode(), digest_size=12).hexdigest()
    return str(runtime_dir() / f"{digest}.sock")


def _elsewhere(path: str) -> list[str]:
    """Where else the socket ``path`` may be: when it lies in this user's folder of the temp dir,
    the same name in this user's random-named folders there (the worker may have found the
    predictable one planted, or made another), if it is a socket of this user's."""
    here = Path(path).parent
    mine = f"{_NAME}-{os.getuid()}"
    if here.name != mine and not here.name.startswith(mine + "-"):
        return []
    out = []
    for folder in _fallbacks(here.parent):
        candidate = folder / Path(path).name
        try:
            st = os.lstat(candidate)
        except OSError:
            continue
        if folder != here and stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid():
            out.append(str(candidate))
    return out


def pack_tokens(tokens: Any) -> str:
    """Token ids (a sequence of ints) as the base64 of their little-endian int64 bytes."""
    ids = array("q", tokens)
    if sys.byteorder != "little":
        ids.byteswap()
    return base64.b64encode(ids.tobytes()).decode("ascii")


def unpack_tokens(packed: str) -> bytearray:
    """The inverse of ``pack_tokens``: the token ids as int64 bytes in this machine's order (for
    ``torch.frombuffer``); ``ValueError`` for anything else."""
    raw = bytearray(base64.b64decode(packed, validate=True))
    if len(raw) % 8:
        raise ValueError(f"packed token ids of {len(raw)} bytes (not whole int64s)")
    if sys.byteorder != "little":
        ids = array("q", raw)
        ids.byteswap()
        raw = bytearray(ids.tobytes())
    return raw


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    return _HEADER.pack(len(body)) + body


class ChannelClient:
    """Blocking client for the scheduler side (and for tools: tests, the benchmark).

    One connection, reconnected on demand; calls are serialised by a lock. ``call`` returns
    ``None`` when the worker cannot be reached or does not answer within ``timeout_s``.
    """

    def __init__(self, path: str, *, timeout_s: float = 5.0, connect_timeout_s: float = 30.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._warned_at = 0.0
        self.failures = 0

    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            for path in (self.path, *_elsewhere(self.path)):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self.timeout_s)
                try:
                    s.connect(path)
                except (FileNotFoundError, ConnectionRefusedError):
                    s.close()
                    continue
                except BaseException:
                    s.close()
                    raise
                if path != self.path:
                    log.info("hicache: the worker channel %s listens at %s", self.path, path)
                    self.path = path
                return s
            if time.monotonic() >= deadline:
                raise FileNotFoundError(f"no hicache worker listens at {self.path}")
            time.sleep(0.05)  # the worker starts listening when vLLM registers its KV caches

    def _recv_exactly(self, s: socket.socket, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = s.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the hicache worker closed the channel")
            buf += chunk
        return bytes(buf)

    def call(self, message: dict[str, Any]) -> dict[str, Any] | None:
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = self._connect()
                self._sock.sendall(encode(message))
                (n,) = _HEADER.unpack(self._recv_exactly(self._sock, _HEADER.size))
                if n > MAX_FRAME:
                    raise ConnectionError(f"frame of {n} bytes")
                reply = json.loads(self._recv_exactly(self._sock, n))
            except (OSError, ValueError) as exc:
                self.failures += 1
                self._drop()
                now = time.monotonic()
                if now - self._warned_at > 10:
                    self._warned_at = now
                    log.warning("hicache: worker channel %s: %r (treated as a miss)", self.path, exc)
                return None
            if "error" in reply:
                self.failures += 1
                log.warning("hicache: worker answered %r: %s", message.get("op"), reply["error"])
                return None
            return reply

    def _drop(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self._drop()
