"""The producer's metadata server of ``kind: nixl-peer``: answers ``peer_wire`` requests about its arena.

Plain threads, not tasks: the backend may be driven by any event loop (or by several, one after
another), and a storage backend owns no task group. One thread accepts, one thread serves each
connection, and ``stop`` closes every socket and joins every thread within a bound.

**Who is answered.** A connection first authenticates (``peer_auth``) within ``auth_timeout_s`` or
is closed; until then it is sent a challenge and nothing else, and no request of it is read.
Authenticated, a request must arrive whole within ``idle_s`` of the last answer (a silent consumer
is dropped and reconnects when it next asks).

**At most ``max_clients`` connections.** One over it makes room, if it can: the oldest connection
that has not authenticated yet is closed, else the authenticated one idle longest (at least
``MIN_IDLE_S``, holding no lease), else the new one is. So idle or unauthenticated sockets delay a
consumer by one handshake at most, not for ``idle_s``.

**Errors of ``accept``** (too many open files, a connection reset before it was accepted) are
logged at most once per ``LOG_EVERY_S`` and backed off from (up to a second); the loop goes on.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from . import peer_auth
from . import peer_wire as wire
from .peer_arena import PageArena

__all__ = ["PeerServer"]

log = logging.getLogger(__name__)

#: An authenticated connection idle this long may be closed to make room for a new one.
MIN_IDLE_S = 1.0
#: At most one log line this often for a kind of repeated failure (accept errors, refusals).
LOG_EVERY_S = 10.0
#: The longest pause after repeated ``accept`` errors.
MAX_BACKOFF_S = 1.0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    id: int
    since: float = field(default_factory=time.monotonic)
    authenticated: bool = False
    busy: bool = False  # between a request and its answer
    last: float = field(default_factory=time.monotonic)  # the end of its last answer


class _EveryNow:
    """Rate-limited logging: a line when ``LOG_EVERY_S`` passed since the last, with how many were held back."""

    def __init__(self) -> None:
        self._last = -LOG_EVERY_S
        self._held = 0

    def __call__(self, level: int, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last < LOG_EVERY_S:
            self._held += 1
            return
        held, self._held, self._last = self._held, 0, now
        log.log(level, message + (f" ({held} more like it not logged)" if held else ""), *args)


class PeerServer:
    def __init__(
        self, arena: PageArena, hello: bytes, host: str, port: int, *, key: bytes, max_clients: int, idle_s: float,
        auth_timeout_s: float,
    ) -> None:
        self.arena = arena
        self.hello = hello
        self.key = key
        self.max_clients = max_clients
        self.idle_s = idle_s
        self.auth_timeout_s = auth_timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.2)  # the accept loop looks at ``_stopping`` this often
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._conns: dict[int, _Conn] = {}
        self._threads: set[threading.Thread] = set()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._log_accept, self._log_refused, self._log_auth = _EveryNow(), _EveryNow(), _EveryNow()
        #: ``accept`` errors survived, and connections refused or closed to make room (for tests and stats).
        self.accept_errors = 0
        self.refused = 0
        self._acceptor = threading.Thread(target=self._accept, name=f"hicache-nixl-peer-{self.address[1]}", daemon=True)
        self._acceptor.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept at once (Linux)
        except OSError:
            pass
        self._acceptor.join(timeout_s)
        self._listener.close()
        with self._lock:
            conns, threads = list(self._conns.values()), list(self._threads)
        for conn in conns:
            _cut(conn.sock)
        for thread in threads:
            thread.join(timeout_s)

    def connections(self) -> tuple[int, int]:
        """``(open, authenticated)`` connections now."""
        with self._lock:
            return len(self._conns), sum(c.authenticated for c in self._conns.values())

    # -- threads ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        backoff = 0.0
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stopping.is_set():
                    return
                self.accept_errors += 1
                backoff = min(MAX_BACKOFF_S, backoff * 2 or 0.01)
                self._log_accept(
                    logging.WARNING, "nixl-peer server %s:%d: accept failed (%s); backing off %.2fs", *self.address,
                    exc, backoff,
                )
                self._stopping.wait(backoff)
                continue
            backoff = 0.0
            try:
                self._admit(sock)
            except Exception as exc:  # noqa: BLE001 - no thread for it (out of threads?): the loop goes on
                sock.close()
                self._log_accept(
                    logging.WARNING, "nixl-peer server %s:%d: a connection dropped: %s", *self.address, exc
                )

    def _admit(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._conns) >= self.max_clients:
                victim = self._victim()
                self.refused += 1
                if victim is None:
                    sock.close()
                    self._log_refused(
                        logging.WARNING, "nixl-peer server %s:%d: %d clients, all busy; one refused", *self.address,
                        self.max_clients,
                    )
                    return
                del self._conns[victim.id]  # its thread ends on the cut socket and cleans up
                _cut(victim.sock)
            conn = _Conn(sock, next(self._ids))
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True, name="hicache-nixl-peer-client")
            self._conns[conn.id] = conn
            self._threads.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._conns.pop(conn.id, None)
                self._threads.discard(thread)
            raise

    def _victim(self) -> _Conn | None:
        """The connection to close for a new one (see the module docstring), or ``None``."""
        pending = [c for c in self._conns.values() if not c.authenticated]
        if pending:
            return min(pending, key=lambda c: c.since)
        now = time.monotonic()
        idle = [
            c for c in self._conns.values()
            if not c.busy and now - c.last >= MIN_IDLE_S and not self.arena.leases_of(c.id)
        ]
        return min(idle, key=lambda c: c.last) if idle else None

    def _serve(self, conn: _Conn) -> None:
        sock = conn.sock
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                channel = peer_auth.server_handshake(sock, self.key, conn.since + self.auth_timeout_s)
            except (peer_auth.AuthError, TimeoutError) as exc:
                self._log_auth(logging.WARNING, "nixl-peer server %s:%d: a peer not authenticated: %s", *self.address,
                               exc or "no proof in time")
                return
            conn.authenticated = True
            channel.send(wire.OK, self.hello, time.monotonic() + self.idle_s)
            conn.last = time.monotonic()
            while not self._stopping.is_set():
                op, body = channel.recv(time.monotonic() + self.idle_s)
                conn.busy = True
                try:
                    answer = self._answer(conn, op, body)
                except wire.WireError as exc:
                    channel.send(wire.ERROR, str(exc).encode(), time.monotonic() + self.idle_s)
                    return  # a client that sends nonsense is not listened to any more
                channel.send(*answer, time.monotonic() + self.idle_s)
                conn.busy, conn.last = False, time.monotonic()
        except (OSError, wire.WireError):
            pass  # closed, timed out, cut, or stopped
        finally:
            self.arena.end_owner(conn.id)  # its leases end with its connection
            with self._lock:
                if self._conns.get(conn.id) is conn:
                    del self._conns[conn.id]
                self._threads.discard(threading.current_thread())
            sock.close()  # last: whoever sees it closed sees it gone from the count

    def _answer(self, conn: _Conn, op: bytes, body: bytes) -> tuple[bytes, bytes]:
        if op == wire.HELLO:
            return wire.OK, self.hello
        if op == wire.LOCATE:
            keys, lease = wire.decode_keys(body)
            lease_id, pages = self.arena.locate(keys, lease=lease, owner=conn.id)
            return wire.OK, wire.encode_located(lease_id, pages)
        if op == wire.RELEASE:
            if len(body) != 8:
                raise wire.WireError("a RELEASE of the wrong length")
            self.arena.release(int.from_bytes(body, "little"), owner=conn.id)
            return wire.OK, b""
        if op == wire.DELETE:
            keys, _ = wire.decode_keys(body)
            self.arena.delete(keys)
            return wire.OK, b""
        raise wire.WireError(f"unknown request {op!r}")


def _cut(sock: socket.socket) -> None:
    """Wake whatever waits on ``sock`` (its thread then closes it)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
