"""The producer's metadata server of ``kind: nixl-peer``: answers ``peer_wire`` requests about its arena.

Plain threads, not tasks: the backend may be driven by any event loop (or by several, one after
another), and a storage backend owns no task group. One thread accepts, one thread serves each
connection (at most ``max_clients`` at once; more are closed at once), every socket has a timeout
(``idle_s``: a silent consumer is dropped, and reconnects when it next asks), and ``stop`` closes
every socket and joins every thread within a bound.
"""

from __future__ import annotations

import logging
import socket
import threading

from . import peer_wire as wire
from .peer_arena import PageArena

__all__ = ["PeerServer"]

log = logging.getLogger(__name__)


class PeerServer:
    def __init__(self, arena: PageArena, hello: bytes, host: str, port: int, *, max_clients: int, idle_s: float) -> None:
        self.arena = arena
        self.hello = hello
        self.max_clients = max_clients
        self.idle_s = idle_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.2)  # the accept loop looks at ``_stopping`` this often
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._clients: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
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
            clients, threads = list(self._clients), list(self._threads)
        for sock in clients:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in threads:
            thread.join(timeout_s)

    # -- threads ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if len(self._clients) >= self.max_clients:
                    sock.close()
                    log.warning("nixl-peer server %s:%d: over %d clients, one refused", *self.address, self.max_clients)
                    continue
                self._clients.add(sock)
                thread = threading.Thread(target=self._serve, args=(sock,), daemon=True, name="hicache-nixl-peer-client")
                self._threads.add(thread)
            thread.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(self.idle_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not self._stopping.is_set():
                op, body = wire.recv_frame(sock)
                try:
                    answer = self._answer(op, body)
                except wire.WireError as exc:
                    wire.send_frame(sock, wire.ERROR, str(exc).encode())
                    return  # a client that sends nonsense is not listened to any more
                wire.send_frame(sock, *answer)
        except (OSError, wire.WireError):
            pass  # closed, timed out, or stopped
        finally:
            sock.close()
            with self._lock:
                self._clients.discard(sock)
                self._threads.discard(threading.current_thread())

    def _answer(self, op: bytes, body: bytes) -> tuple[bytes, bytes]:
        if op == wire.HELLO:
            return wire.OK, self.hello
        if op == wire.LOCATE:
            keys, lease = wire.decode_keys(body)
            lease_id, pages = self.arena.locate(keys, lease=lease)
            return wire.OK, wire.encode_located(lease_id, pages)
        if op == wire.RELEASE:
            if len(body) != 8:
                raise wire.WireError("a RELEASE of the wrong length")
            self.arena.release(int.from_bytes(body, "little"))
            return wire.OK, b""
        if op == wire.DELETE:
            keys, _ = wire.decode_keys(body)
            self.arena.delete(keys)
            return wire.OK, b""
        raise wire.WireError(f"unknown request {op!r}")
