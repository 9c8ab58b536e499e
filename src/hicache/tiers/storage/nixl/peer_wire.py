"""The metadata exchange of ``kind: nixl-peer``: small framed messages over a TCP socket.

Page bytes never cross this socket: they move over UCX, read by the consumer from the producer's
registered arena. The socket carries who the producer is and where its pages are:

* ``HELLO`` -> the protocol magic, the producer's NIXL agent metadata (what UCX needs to reach its
  memory), and the arena's address and size;
* ``LOCATE`` (keys, lease flag) -> a lease id and, for the consecutive pages present from the first,
  each one's size and byte ranges in the arena;
* ``RELEASE`` (lease id) -> nothing: the pages may be reused;
* ``DELETE`` (keys) -> nothing: a consumer found them corrupt.

A frame is ``u32 length | u8 op | body`` (little-endian), at most ``MAX_FRAME`` bytes; an error
answer is op ``X`` with a message. The other side is not trusted: every count and length is
checked against the frame before it is used, and every range against the arena's size.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Sequence

from ....keys import KEY_BYTES
from .peer_arena import MAX_SPANS, Located

__all__ = [
    "DELETE", "ERROR", "HELLO", "LOCATE", "MAGIC", "MAX_FRAME", "RELEASE", "WireError", "decode_hello",
    "decode_keys", "decode_located", "encode_hello", "encode_keys", "encode_located", "recv_frame", "send_frame",
]

MAGIC = b"HCNXPR01"
HELLO, LOCATE, RELEASE, DELETE, ERROR, OK = b"H", b"L", b"R", b"D", b"X", b"K"
MAX_FRAME = 8 * 1024**2
MAX_KEYS = 4096

_FRAME = struct.Struct("<Ic")
_HELLO = struct.Struct("<8sQQI")  # magic, arena address, arena bytes, metadata length
_KEYS = struct.Struct("<BI")  # flags (1: lease), key count
_LOCATED = struct.Struct("<QI")  # lease id, page count
_PAGE = struct.Struct("<QH")  # size, span count
_SPAN = struct.Struct("<QQ")  # offset, length


class WireError(ConnectionError):
    """The peer sent something that is not a valid answer (or closed the connection)."""


def send_frame(sock: socket.socket, op: bytes, body: bytes = b"") -> None:
    if len(body) + 1 > MAX_FRAME:
        raise WireError(f"a frame of {len(body)} bytes is over {MAX_FRAME}")
    sock.sendall(_FRAME.pack(len(body) + 1, op) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise WireError("the peer closed the connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[bytes, bytes]:
    """``(op, body)`` of the next frame; ``WireError`` for a closed or oversized one."""
    length, op = _FRAME.unpack(_recv_exactly(sock, _FRAME.size))
    if not 1 <= length <= MAX_FRAME:
        raise WireError(f"a frame of {length} bytes (at most {MAX_FRAME})")
    return op, _recv_exactly(sock, length - 1)


def encode_hello(metadata: bytes, address: int, size: int) -> bytes:
    return _HELLO.pack(MAGIC, address, size, len(metadata)) + metadata


def decode_hello(body: bytes) -> tuple[bytes, int, int]:
    """``(agent metadata, arena address, arena bytes)``."""
    if len(body) < _HELLO.size:
        raise WireError("a short HELLO answer")
    magic, address, size, n = _HELLO.unpack_from(body)
    if magic != MAGIC:
        raise WireError("not a hicache nixl-peer server (or another protocol version)")
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
