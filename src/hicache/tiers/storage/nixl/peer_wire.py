"""The metadata exchange of ``kind: nixl-peer``: small framed messages over a TCP socket.

Page bytes never cross this socket: they move over UCX, read by the consumer from the producer's
registered arena. The socket carries who the producer is and where its pages are, and only after
the two sides authenticated each other (``peer_auth``: ``AUTH``, then every frame MACed):

* ``AUTH`` (magic, nonce) -> the magic and the producer's nonce: nothing else before the proof;
* ``HELLO`` -> the producer's NIXL agent metadata (what UCX needs to reach its memory), and the
  arena's address and size;
* ``LOCATE`` (keys, lease flag) -> a lease id and, for the consecutive pages present from the first,
  each one's size and byte ranges in the arena;
* ``RELEASE`` (lease id) -> nothing: the pages may be reused;
* ``DELETE`` (keys) -> nothing: a consumer found them corrupt.

A frame is ``u32 length | u8 op | body`` (little-endian), at most ``MAX_FRAME`` bytes; an error
answer is op ``X`` with a message. Every read and write of a frame has a deadline (a peer that
drips its bytes is cut at it, not waited on byte by byte). The other side is not trusted: every
count and length is checked against the frame before it is used, and every range against the
arena's size.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence

from ....keys import KEY_BYTES
from .peer_arena import MAX_SPANS, Located

__all__ = [
    "AUTH", "DELETE", "ERROR", "HELLO", "LOCATE", "MAGIC", "MAX_FRAME", "RELEASE", "WireError", "decode_hello",
    "decode_keys", "decode_located", "encode_hello", "encode_keys", "encode_located", "recv_frame", "send_frame",
]

#: The protocol and its version: 02 authenticates both sides first (``peer_auth``); 01 did not.
MAGIC = b"HCNXPR02"
AUTH, HELLO, LOCATE, RELEASE, DELETE, ERROR, OK = b"A", b"H", b"L", b"R", b"D", b"X", b"K"
MAX_FRAME = 8 * 1024**2
MAX_KEYS = 4096

_FRAME = struct.Struct("<Ic")
_HELLO = struct.Struct("<QQI")  # arena address, arena bytes, metadata length
_KEYS = struct.Struct("<BI")  # flags (1: lease), key count
_LOCATED = struct.Struct("<QI")  # lease id, page count
_PAGE = struct.Struct("<QH")  # size, span count
_SPAN = struct.Struct("<QQ")  # offset, length


class WireError(ConnectionError):
    """The peer sent something that is not a valid answer (or closed the connection)."""


def _left(sock: socket.socket, deadline: float) -> None:
    """Give the socket's next call what is left until ``deadline``; ``TimeoutError`` when nothing is."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer's exchange ran past its deadline")
    sock.settimeout(left)


def send_frame(sock: socket.socket, op: bytes, body: bytes, deadline: float) -> None:
    """Send one frame, all of it by ``deadline`` (a peer that stops reading is cut there)."""
    if len(body) + 1 > MAX_FRAME:
        raise WireError(f"a frame of {len(body)} bytes is over {MAX_FRAME}")
    _left(sock, deadline)
    sock.sendall(_FRAME.pack(len(body) + 1, op) + body)  # the timeout bounds the whole sendall


def _recv_exactly(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        _left(sock, deadline)  # the deadline is for the whole frame: a dripping peer gains nothing
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket, deadline: float, limit: int = MAX_FRAME) -> tuple[bytes, bytes]:
    """``(op, body)`` of the next frame, all of it by ``deadline``; ``WireError`` for a closed one or
    one over ``limit`` bytes (before authentication, frames are a few dozen bytes: nothing larger is
    read), ``TimeoutError`` past the deadline."""
    length, op = _FRAME.unpack(_recv_exactly(sock, _FRAME.size, deadline))
    if not 1 <= length <= limit:
        raise WireError(f"a frame of {length} bytes (at most {limit})")
    return op, _recv_exactly(sock, length - 1, deadline)


def encode_hello(metadata: bytes, address: int, size: int) -> bytes:
    return _HELLO.pack(address, size, len(metadata)) + metadata


def decode_hello(body: bytes) -> tuple[bytes, int, int]:
    """``(agent metadata, arena address, arena bytes)``."""
    if len(body) < _HELLO.size:
        raise WireError("a short HELLO answer")
    address, size, n = _HELLO.unpack_from(body)
    if len(body) != _HELLO.size + n:
        raise WireError("a HELLO answer of the wrong length")
    return body[_HELLO.size :], address, size


def encode_keys(keys: Sequence[bytes], *, lease: bool = False) -> bytes:
    return _KEYS.pack(1 if lease else 0, len(keys)) + b"".join(keys)


def decode_keys(body: bytes) -> tuple[list[bytes], bool]:
    if len(body) < _KEYS.size:
        raise WireError("a short key list")
    flags, n = _KEYS.unpack_from(body)
    if n > MAX_KEYS or len(body) != _KEYS.size + n * KEY_BYTES:
        raise WireError("a key list of the wrong length")
    keys = [body[_KEYS.size + i * KEY_BYTES : _KEYS.size + (i + 1) * KEY_BYTES] for i in range(n)]
    return keys, bool(flags & 1)


def encode_located(lease_id: int, pages: Sequence[Located]) -> bytes:
    parts = [_LOCATED.pack(lease_id, len(pages))]
    for page in pages:
        parts.append(_PAGE.pack(page.size, len(page.spans)))
        parts.extend(_SPAN.pack(offset, length) for offset, length in page.spans)
    return b"".join(parts)


def decode_located(body: bytes, arena_bytes: int, asked: int) -> tuple[int, list[Located]]:
    """``(lease id, pages)``; every page's ranges lie in the arena and add up to its size."""
    if len(body) < _LOCATED.size:
        raise WireError("a short LOCATE answer")
    lease_id, n = _LOCATED.unpack_from(body)
    if n > asked:
        raise WireError(f"{n} pages located for {asked} keys")
    pos, pages = _LOCATED.size, []
    for _ in range(n):
        if pos + _PAGE.size > len(body):
            raise WireError("a truncated LOCATE answer")
        size, count = _PAGE.unpack_from(body, pos)
        pos += _PAGE.size
        if count > MAX_SPANS or pos + count * _SPAN.size > len(body):
            raise WireError("a truncated LOCATE answer")
        spans = tuple(_SPAN.unpack_from(body, pos + j * _SPAN.size) for j in range(count))
        pos += count * _SPAN.size
        if sum(length for _, length in spans) != size or any(
            length == 0 or offset + length > arena_bytes for offset, length in spans
        ):
            raise WireError("a located page's ranges do not fit the arena or its size")
        pages.append(Located(size, spans))
    if pos != len(body):
        raise WireError("a LOCATE answer of the wrong length")
    return lease_id, pages
