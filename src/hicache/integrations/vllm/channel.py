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
is still accepted). The socket sits in a per-user folder
(mode 0700, owner checked) under the temp dir or ``$HICACHE_VLLM_RUNTIME_DIR``, named after a
digest of vLLM's engine id, which both processes share. Every wait is bounded; a failed or slow
answer is a miss (the request is computed), never an engine error.
"""

from __future__ import annotations

import base64
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

__all__ = ["socket_path", "ChannelClient", "encode", "pack_tokens", "unpack_tokens", "MAX_FRAME"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

MAX_FRAME = 64 << 20  # a lookup of 1M tokens is ~8 MB of JSON
_HEADER = struct.Struct(">I")


def _runtime_dir() -> Path:
    base = os.environ.get("HICACHE_VLLM_RUNTIME_DIR") or os.path.join(tempfile.gettempdir(), f"hicache-vllm-{os.getuid()}")
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} must be owned by this user and not writable by others")
    return path


def socket_path(engine_id: str, rank: int = 0) -> str:
    """Where worker ``rank`` (its TP rank) of vLLM engine ``engine_id`` listens (the same in every
    process of the engine). Rank 0's name is the one a single-rank engine always had."""
    name = engine_id if rank == 0 else f"{engine_id}\0rank{rank}"
    digest = hashlib.blake2b(name.encode(), digest_size=12).hexdigest()
    return str(_runtime_dir() / f"{digest}.sock")


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
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout_s)
            try:
                s.connect(self.path)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)  # the worker starts listening when vLLM registers its KV caches
            except BaseException:
                s.close()
                raise

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
