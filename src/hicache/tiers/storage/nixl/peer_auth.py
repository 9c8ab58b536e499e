"""Who may talk to a ``kind: nixl-peer`` producer: a challenge-response on a shared secret, then MACed frames.

The producer's HELLO answer is the key to its arena (a stranger's own NIXL agent can READ and WRITE
it with that metadata), so nothing but a challenge goes out before the consumer proved it holds the
secret, and the consumer knows it talks to the real producer from the first answer on::

    consumer -> AUTH   MAGIC | consumer nonce                  (plain, a few dozen bytes at most)
    producer -> OK     MAGIC | producer nonce                  (plain: nothing else before the proof)
    consumer -> HELLO  sealed with the consumer's session key  (its proof: only the secret gives the MAC)
    producer -> OK     sealed with the producer's session key  (its proof, and the agent metadata)

A session key is ``HMAC-SHA256(K, direction | MAGIC | both nonces)``: one per direction (a MAC is
never reflected back as the other side's), new for every connection (a recorded exchange replays
nowhere). Every frame after the ``AUTH`` exchange carries ``HMAC(session key, frame number | op |
body)`` cut to 16 bytes, so no frame is forged, changed, replayed or reordered within a connection.
Frames are authenticated, not encrypted: they carry page names and places, never page bytes (those
go over UCX and are checked by the tier: a checksum, or a MAC with a tenant key).

``K`` is HKDF-SHA256 of ``peer_token``, else of the tenant key's subkey for this purpose (so two
processes with one ``tenant_key`` need nothing more), else of nothing: a producer without a secret
listens on loopback only, and its exchange then proves nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from . import peer_wire as wire

__all__ = ["AuthError", "Channel", "client_handshake", "peer_key", "server_handshake"]

NONCE = 32
TAG = 16
#: The tenant key's subkey for this purpose (``TenantKey.derive``, at most 16 characters).
TENANT_PURPOSE = "nixl-peer-auth"
#: The largest frame read before the other side is authenticated: ``AUTH``, the challenge, the proof.
_PRE_AUTH_FRAME = 1 + len(wire.MAGIC) + NONCE


class AuthError(wire.WireError):
    """The other side does not hold the secret (a MAC that does not match), or refused ours."""


def peer_key(token: str | None, tenant_secret: bytes | None) -> tuple[bytes, bool]:
    """``(K, whether it is a secret)``: from ``peer_token``, else the tenant key's subkey, else none."""
    if token is not None:
        material, label, secret = token.encode(), b"peer_token", True
    elif tenant_secret is not None:
        material, label, secret = tenant_secret, b"tenant_key", True
    else:
        material, label, secret = b"", b"none", False
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"hicache nixl-peer auth v2 " + label)
    return hkdf.derive(material), secret


def _session_keys(key: bytes, nonce_c: bytes, nonce_s: bytes) -> tuple[bytes, bytes]:
    """``(consumer-to-producer key, producer-to-consumer key)``."""
    transcript = wire.MAGIC + nonce_c + nonce_s
    return (
        hmac.digest(key, b"c2s" + transcript, hashlib.sha256),
        hmac.digest(key, b"s2c" + transcript, hashlib.sha256),
    )


class Channel:
    """A connection after the ``AUTH`` exchange: frames sealed and checked with the session keys."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes) -> None:
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0

    @staticmethod
    def _tag(key: bytes, number: int, op: bytes, body: bytes) -> bytes:
        return hmac.digest(key, number.to_bytes(8, "little") + op + body, hashlib.sha256)[:TAG]

    def send(self, op: bytes, body: bytes, deadline: float) -> None:
        wire.send_frame(self.sock, op, body + self._tag(self._send_key, self._sent, op, body), deadline)
        self._sent += 1

    def open(self, op: bytes, sealed: bytes) -> bytes:
        """The body of a received frame; ``AuthError`` if its MAC is not the other side's."""
        body, tag = sealed[:-TAG], sealed[-TAG:]
        if len(sealed) < TAG or not hmac.compare_digest(tag, self._tag(self._recv_key, self._received, op, body)):
            raise AuthError("a frame whose MAC does not match (another secret, or not the peer it says)")
        self._received += 1
        return body

    def recv(self, deadline: float, limit: int = wire.MAX_FRAME) -> tuple[bytes, bytes]:
        op, sealed = wire.recv_frame(self.sock, deadline, limit)
        return op, self.open(op, sealed)


def client_handshake(sock: socket.socket, key: bytes, deadline: float) -> tuple[Channel, bytes]:
    """Authenticate both sides as the consumer; ``(channel, the producer's HELLO answer)``."""
    nonce_c = secrets.token_bytes(NONCE)
    wire.send_frame(sock, wire.AUTH, wire.MAGIC + nonce_c, deadline)
    op, body = wire.recv_frame(sock, deadline, wire.MAX_FRAME)
    if op == wire.ERROR:
        raise AuthError(f"the producer refused the exchange: {body[:200]!r}")
    if op != wire.OK or len(body) != len(wire.MAGIC) + NONCE or body[: len(wire.MAGIC)] != wire.MAGIC:
        raise wire.WireError("not a hicache nixl-peer producer of this protocol version")
    to_server, from_server = _session_keys(key, nonce_c, body[len(wire.MAGIC) :])
    channel = Channel(sock, to_server, from_server)
    channel.send(wire.HELLO, b"", deadline)
    op, sealed = wire.recv_frame(sock, deadline, wire.MAX_FRAME)
    if op == wire.ERROR and len(sealed) < 64 and sealed.startswith(b"not authenticated"):
        raise AuthError("the producer refused our proof: not the same peer_token (or tenant_key) on both sides")
    hello = channel.open(op, sealed)  # AuthError: the producer does not hold the secret
    if op != wire.OK:
        raise wire.WireError(f"HELLO refused: {hello[:200]!r}")
    return channel, hello


def server_handshake(sock: socket.socket, key: bytes, deadline: float) -> Channel:
    """Authenticate the consumer as the producer, all by ``deadline``; the channel once its HELLO
    (its proof) checked. A consumer that fails is sent one plain error and nothing else."""
    op, body = wire.recv_frame(sock, deadline, _PRE_AUTH_FRAME)
    if op != wire.AUTH or len(body) != len(wire.MAGIC) + NONCE or body[: len(wire.MAGIC)] != wire.MAGIC:
        refusal = b"hicache nixl-peer protocol " + wire.MAGIC + b": authenticate first"
        wire.send_frame(sock, wire.ERROR, refusal, deadline)
        raise AuthError("a peer that did not start with AUTH (of this protocol version)")
    nonce_s = secrets.token_bytes(NONCE)
    wire.send_frame(sock, wire.OK, wire.MAGIC + nonce_s, deadline)
    from_client, to_client = _session_keys(key, body[len(wire.MAGIC) :], nonce_s)
    channel = Channel(sock, to_client, from_client)
    try:
        op, _ = channel.recv(deadline, _PRE_AUTH_FRAME)
        if op != wire.HELLO:
            raise AuthError("a first request that is not HELLO")
    except AuthError:
        wire.send_frame(sock, wire.ERROR, b"not authenticated", deadline)
        raise
    return channel
