"""Pages moved between Valkey/Redis and their buffers with no copy: ``GET`` replies received by the
socket into the host pages, a whole value in one ``recv`` (``MSG_WAITALL``), and ``SET`` commands
sent from the pages' own buffers in one blocking ``sendmsg`` per batch.

Why: redis-py hands back each value as fresh ``bytes`` (hiredis reads the socket 2 MiB at a time,
builds the object, the backend copies it into the page), and every one of those steps needs the
GIL, which an engine's own thread holds most of the time in the process the cache serves. Received
here, a 5.6 MiB page costs four system calls and no copy (measured here, one process, a thread
burning Python beside the reader: 1.3-1.4 GB/s against 0.8 through hiredis; quiet, 2.6-3.0 against
1.0-2.9).

Only on plain TCP and unix sockets (``MSG_WAITALL`` and ``sendmsg`` do not go through TLS;
``rediss://`` uses redis-py's pipeline). The connection comes from the blocking client's pool,
which hands out only one with nothing left to read, and goes back the same way: every reply of the batch is consumed (values that
do not fit drained), or the connection is closed. Every wait is bounded by one deadline for the call.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .base import PageIO, fits

__all__ = ["get_into", "set_from"]

_LINE_MAX = 64 << 10  # a reply's first line: "$" and a length, or an error's message
_DRAIN_MAX = 256 << 20  # bytes of values that do not fit we read past; more closes the connection


class _Protocol(Exception):
    """The reply was not what the command answers, or the server closed the connection: close ours."""


class _Late(TimeoutError):
    """The call's timeout passed before its last reply (a timeout, as the backend counts them)."""


def get_into(client: Any, names: Sequence[bytes], into: Sequence[PageIO], variable: bool, timeout_s: float,
             ) -> list[object]:
    """``GET`` each of ``names`` (pipelined, one pooled connection of the blocking ``client``), each
    value received into ``into[i]``'s buffers. Per name: the value's length (it landed, from the
    start of the buffers), ``None`` (no such key), the length of a value that does not fit (exactly
    ``nbytes``, or with ``variable`` a header and at most ``nbytes``: not received), or the exception
    of an error reply. A broken connection raises (every name's)."""
    deadline = time.monotonic() + timeout_s
    with _connection(client) as (conn, sock):
        conn.send_packed_command(conn.pack_commands([("GET", name) for name in names]), check_health=False)
        return _receive(sock, into, variable, deadline)


@contextmanager
def _connection(client: Any) -> Iterator[tuple[Any, socket.socket]]:
    """A pooled connection of ``client`` (the pool checks it has nothing left to read, and reconnects
    one the server closed) and its socket, blocking (``MSG_WAITALL`` waits for a whole value, the
    kernel sends a whole batch, both bounded by ``SO_RCVTIMEO``/``SO_SNDTIMEO``). It goes back to the
    pool as it came, or closed when anything failed (replies may be left unread)."""
    from redis.exceptions import TimeoutError as RedisTimeout

    pool = client.connection_pool
    try:
        conn = pool.get_connection()
    except RedisTimeout as exc:  # connecting, or the pool's check
        raise _Late(str(exc)) from exc
    clean = False
    sock = conn._sock
    try:
        sock.settimeout(None)
        yield conn, sock
        clean = True
    finally:
        if clean:
            sock.settimeout(conn.socket_timeout)
        else:
            conn.disconnect()
        pool.release(conn)


def set_from(client: Any, names: Sequence[bytes], pages: Sequence[PageIO], ttl_s: int | None,
             timeout_s: float) -> list[object]:
    """``SET`` each of ``names`` to ``pages[i]``'s buffers joined (header, then payload), with
    ``EX ttl_s`` when given: pipelined on one pooled connection, sent from the buffers themselves.
    Per name: ``True``, or the exception of an error reply. A broken connection raises."""
    deadline = time.monotonic() + timeout_s
    ex = [b"$2\r\nEX\r\n" + _bulk_head(str(ttl_s).encode()) + str(ttl_s).encode() + b"\r\n"] if ttl_s else []
    parts: list[Any] = []
    for name, io in zip(names, pages, strict=True):
        parts.append(f"*{5 if ttl_s else 3}\r\n$3\r\nSET\r\n".encode() + _bulk_head(name) + name + b"\r\n"
                     + _bulk_head(b"", io.nbytes))
        parts.extend(buf for buf in io.buffers() if len(buf))
        parts.append(b"\r\n")
        parts.extend(ex)
    with _connection(client) as (_, sock):
        _send(sock, parts, deadline)
        return _replies(sock, len(names), deadline)


def _bulk_head(value: bytes, size: int | None = None) -> bytes:
    return f"${len(value) if size is None else size}\r\n".encode()


_IOV = 512  # buffers per sendmsg (the kernel takes at most IOV_MAX, 1024 on Linux)


def _send(sock: socket.socket, parts: list[Any], deadline: float) -> None:
    views = [memoryview(p).cast("B") for p in parts]
    i = 0
    while i < len(views):
        _bound(sock, socket.SO_SNDTIMEO, deadline)
        try:
            n = sock.sendmsg(views[i : i + _IOV])
        except (BlockingIOError, InterruptedError):
            continue
        while n > 0:  # what went: whole buffers, then part of one
            if n >= len(views[i]):
                n -= len(views[i])
                i += 1
            else:
                views[i] = views[i][n:]
                n = 0


def _replies(sock: socket.socket, count: int, deadline: float) -> list[object]:
    from redis.exceptions import ResponseError

    out: list[object] = []
    for _ in range(count):
        line = _line(sock, deadline)
        if line == b"+OK":
            out.append(True)
        elif line[:1] == b"-":
            out.append(ResponseError(line[1:].decode("utf-8", "replace")))
        else:
            raise _Protocol(f"a SET answered {line[:16]!r}")
    return out


def _receive(sock: socket.socket, into: Sequence[PageIO], variable: bool, deadline: float) -> list[object]:
    from redis.exceptions import ResponseError

    out: list[object] = []
    drained = 0
    for io in into:
        line = _line(sock, deadline)
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            out.append(ResponseError(rest.decode("utf-8", "replace")))
            continue
        if kind == b"_":  # RESP3's null
            out.append(None)
            continue
        if kind != b"$" or not rest.lstrip(b"-").isdigit():
            raise _Protocol(f"a GET answered {line[:16]!r}")
        size = int(rest)
        if size < 0:  # RESP2's null
            out.append(None)
            continue
        if not fits(size, io.nbytes, [] if variable else None):  # (fits asks only whether sizes vary)
            drained += size
            if drained > _DRAIN_MAX:
                raise _Protocol("values that do not fit: too many bytes to read past")
            _drain(sock, size + 2, deadline)
            out.append(size)
            continue
        left = size
        for buf in io.buffers():
            if left <= 0:
                break
            n = min(len(buf), left)
            _exactly(sock, buf[:n], deadline)
            left -= n
        if _exactly(sock, bytearray(2), deadline) != b"\r\n":
            raise _Protocol("a value did not end where its length said")
        out.append(size)
        if io.landed is not None and not variable:
            io.landed()
    return out


def _bound(sock: socket.socket, option: int, deadline: float) -> None:
    """The next blocking ``recv`` (``SO_RCVTIMEO``) or ``sendmsg`` (``SO_SNDTIMEO``) waits at most
    until ``deadline``; ``_Late`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise _Late("no whole answer within the call's timeout")
    sec = int(left)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, int((left - sec) * 1e6) or 1))


def _exactly(sock: socket.socket, buf: Any, deadline: float) -> Any:
    """Fill ``buf`` from the socket (one ``recv`` unless the wait is cut short); it, filled."""
    view = memoryview(buf).cast("B")
    pos = 0
    while pos < len(view):
        _bound(sock, socket.SO_RCVTIMEO, deadline)
        try:
            n = sock.recv_into(view[pos:], len(view) - pos, socket.MSG_WAITALL)
        except (BlockingIOError, InterruptedError):  # SO_RCVTIMEO ran out (or a signal): check the deadline
            continue
        if n == 0:
            raise _Protocol("the server closed the connection")
        pos += n
    return buf


def _line(sock: socket.socket, deadline: float) -> bytes:
    """A reply's first line, without its CRLF (peeked, then consumed exactly)."""
    size = 64  # a length line is a few bytes; an error's message may be longer
    while True:
        _bound(sock, socket.SO_RCVTIMEO, deadline)
        try:
            peek = sock.recv(size, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            continue
        if not peek:
            raise _Protocol("the server closed the connection")
        end = peek.find(b"\r\n")
        if end >= 0:
            return bytes(_exactly(sock, bytearray(end + 2), deadline)[:end])
        if len(peek) >= _LINE_MAX:
            raise _Protocol("a reply line longer than any a GET or SET answers")
        if len(peek) >= size:
            size *= 4
        else:
            time.sleep(0.0005)  # the rest of the line is on its way


def _drain(sock: socket.socket, n: int, deadline: float) -> None:
    scratch = bytearray(min(n, 1 << 20))
    while n > 0:
        k = min(n, len(scratch))
        _exactly(sock, memoryview(scratch)[:k], deadline)
        n -= k
