"""A ``kind: nixl-peer`` consumer's calls to its producers: each peer's connection state, and each
call's one deadline and its cancellation.

A ``Call`` is one verb run in a worker thread. Everything it waits on is bounded by its deadline
(``acquire`` for locks, ``peer_wire`` for sockets, the transfer's own deadline), and ``cancel``
cuts it short from another thread: the socket it waits on is shut down (its ``recv`` returns at
once), its transfer stops being waited for (``stop``), and a lock wait gives up within 50 ms.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
import time

from . import peer_auth

__all__ = ["Call", "Cancelled", "Peer", "PeerDown", "PeerFailed", "acquire", "host_port", "loopback"]

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>\d{1,5})$")


def host_port(text: str) -> tuple[str, int]:
    """``("host", port)`` from ``host:port`` or ``[v6]:port``; ``ValueError`` otherwise."""
    m = _HOST_PORT.match(text)
    if m is None or int(m["port"]) > 65535:
        raise ValueError(f"expected host:port (or [ipv6]:port), got {text!r}")
    return (m["v6"] or m["host"]), int(m["port"])


def loopback(host: str) -> bool:
    """Whether ``host`` is this machine only (``localhost`` or a loopback address; a name is not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PeerFailed(ConnectionError):
    """A peer did not answer, answered nonsense, or a transfer from it failed."""


class PeerDown(PeerFailed):
    """A peer that failed less than ``retry_s`` ago: not asked (its pages are plain misses)."""


class Cancelled(Exception):
    """The call was cancelled (by its caller, its ``timeout_s`` or ``aclose``): not the peer's fault."""


class Peer:
    """One producer as a consumer sees it: a connection, its agent's name, its arena's bounds."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.channel: peer_auth.Channel | None = None
        self.agent_name: str | None = None
        self.arena_address = 0
        self.arena_bytes = 0
        self.down_until = 0.0
        self.lock = threading.Lock()  # one request on the connection at a time

    def cut(self) -> None:
        """Wake a thread blocked on this peer's socket (it then fails its exchange and disconnects)."""
        channel = self.channel
        if channel is not None:
            try:
                channel.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __str__(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


class Call:
    """One verb's run in a worker thread: its deadline, and a way to cut it short from outside."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.stop = threading.Event()  # set: cancelled
        self.finished = threading.Event()
        self._lock = threading.Lock()
        self._started = False
        self._peers: list[Peer] = []  # whose socket it is using now

    def start(self) -> None:
        with self._lock:
            if self.stop.is_set():
                raise Cancelled("cancelled (by the caller, its timeout_s, or the backend closing)")
            self._started = True

    def cancel(self) -> bool:
        """Stop the call; whether its thread started (and so must be waited for)."""
        with self._lock:
            self.stop.set()
            for peer in self._peers:
                peer.cut()
            return self._started and not self.finished.is_set()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check(self) -> None:
        if self.stop.is_set():
            raise Cancelled("cancelled (by the caller, its timeout_s, or the backend closing)")

    def using(self, peer: Peer | None) -> None:
        """The peer whose socket the call waits on now (``None``: none); cut at once if cancelled."""
        with self._lock:
            self._peers = [] if peer is None else [peer]
            if peer is not None and self.stop.is_set():
                peer.cut()


def acquire(lock: threading.Lock, call: Call, what: str) -> None:
    """Take ``lock`` by the call's deadline, giving up at once if it is cancelled."""
    while not lock.acquire(timeout=max(0.0, min(0.05, call.left()))):
        call.check()
        if call.left() <= 0:
            raise PeerFailed(f"{what} was busy until the call's deadline")
