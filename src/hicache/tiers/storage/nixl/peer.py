"""``kind: nixl-peer``: the consumer pulls pages from the producer's memory over UCX, no store in between.

For prefill/decode disaggregation: the prefill process (the producer) keeps the pages it stores in
memory it registered with NIXL, and the decode process (the consumer) reads them straight from
there with one UCX READ per batch (shared memory or CMA on one machine, TCP or RDMA across
machines), as vLLM's ``NixlConnector`` does with its KV blocks. To the cache it is a storage tier
like any other: pages are named by their storage keys and verified by the tier as every storage
read (header, checksum or MAC), so nothing of either side's block layout crosses, and a consumer of
another model, tenant or page size gets no KV.

One backend plays either role or both::

    - kind: nixl-peer            # the prefill server: serve the pages stored here
      listen: 0.0.0.0:7400
      capacity: 8GiB             # the registered arena the pages live in (LRU-evicted)
    - kind: nixl-peer            # the decode server: pull from these producers
      peers: [prefill-host:7400]

* **Producer** (``listen``): ``set`` copies each page into the arena (``peer_arena.PageArena``:
  byte-exact placement, least recently used evicted, leases for readers) and a metadata server
  (``peer_server``) tells consumers the agent's metadata and where each page is (``peer_wire``).
  Its own ``get`` copies from the arena (a ``kv_both`` server reads its own pages).
* **Consumer** (``peers``): ``exists`` asks the peers in order (its own arena first, if it has one);
  ``get`` locates pages under a lease, reads them over UCX into the tier's buffers (the host pool's
  pages, registered for the call) and releases the lease. A consumer without ``listen`` is not
  ``writable``: the cache writes it nothing and its write policy promises it nothing (``set`` stores
  0 pages if called). ``delete`` also asks the peers to drop the pages (the tier deletes a page that
  failed verification), ``clear`` clears only its own arena.

**Bounded, and a producer gone is a miss.** Connecting waits ``connect_timeout_s``, each request
and each transfer ``timeout_s``. A peer that fails (refused, reset, silent, a transfer error) is
skipped for ``retry_s``, during which its pages are plain misses; the call that saw the failure
raises ``StorageBackendError`` when nothing else answered, which the tier counts and turns into a
miss. A read is never left running into the caller's memory: the worker thread waits for the
transfer to end or be cancelled.

**Trust.** Anyone who reaches ``listen`` can read the arena (the agent metadata is the key to it),
as with vLLM's NIXL side channel: bind it to loopback or the cluster's private network. What a
consumer reads is verified by the tier; what a producer is told is checked (``peer_wire``).
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch
from pydantic import Field, field_validator, model_validator

from ....config import ByteSize
from ....errors import StorageBackendError
from ...prefault import populate_in_background
from ..base import BackendSettings, PageIO, StorageBackend, fits
from . import peer_wire as wire
from .agent import NixlAgent, Region, TransferFailed, pair, regions_of
from .peer_arena import PageArena
from .peer_server import PeerServer

__all__ = ["NixlPeerBackend"]

log = logging.getLogger(__name__)

#: Bytes per UCX READ when the caller checks pages as they land: small enough that checking the
#: first part overlaps most of the batch's transfer, large enough that a READ's set-up (tens of
#: microseconds) is small against moving it (~3 ms at 5 GB/s).
PART_BYTES = 16 * 2**20

_HOST_PORT = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>\d{1,5})$")


def host_port(text: str) -> tuple[str, int]:
    """``("host", port)`` from ``host:port`` or ``[v6]:port``; ``ValueError`` otherwise."""
    m = _HOST_PORT.match(text)
    if m is None or int(m["port"]) > 65535:
        raise ValueError(f"expected host:port (or [ipv6]:port), got {text!r}")
    return (m["v6"] or m["host"]), int(m["port"])


class PeerFailed(ConnectionError):
    """A peer did not answer, answered nonsense, or a transfer from it failed."""


class PeerDown(PeerFailed):
    """A peer that failed less than ``retry_s`` ago: not asked (its pages are plain misses)."""


class _Peer:
    """One producer as a consumer sees it: a connection, its agent's name, its arena's bounds."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.sock: socket.socket | None = None
        self.agent_name: str | None = None
        self.arena_address = 0
        self.arena_bytes = 0
        self.down_until = 0.0
        self.lock = threading.Lock()  # one request on the connection at a time

    def __str__(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"


class NixlPeerBackend(StorageBackend):
    kind = "nixl-peer"
    variable_size_pages = True

    class Settings(BackendSettings):
        #: Serve the pages stored here on ``host:port`` (port 0: any free port; see ``address``).
        listen: str | None = None
        #: Producers to pull from, ``host:port`` each, asked in order.
        peers: list[str] = Field(default_factory=list)
        #: Bytes of the producer's registered arena (the pages it serves, least recently used evicted).
        capacity: ByteSize = 1024**3
        connect_timeout_s: float = Field(default=2.0, gt=0)
        #: A peer that failed is not asked again for this long (its pages are misses meanwhile).
        retry_s: float = Field(default=5.0, ge=0)
        #: How long a consumer's read holds the pages it located (released as soon as it is done).
        lease_s: float = Field(default=30.0, gt=0)
        max_clients: int = Field(default=64, ge=1)
        #: A consumer connection silent this long is closed by the producer (the consumer reconnects).
        idle_s: float = Field(default=300.0, gt=0)
        #: Fault the arena's pages in from open on, in a background thread (``tiers/prefault.py``):
        #: the first write into each fresh page is a page fault, and on a VM that hands free memory
        #: back to its host one in the host too (a 23.6 MB copy into a fresh arena took 63 ms here,
        #: 3.9 ms into a faulted one). The arena then holds ``capacity`` of memory from the start.
        prefault: bool = False

        @field_validator("listen")
        @classmethod
        def _listen_parses(cls, value: str | None) -> str | None:
            if value is not None:
                host_port(value)
            return value

        @field_validator("peers")
        @classmethod
        def _peers_parse(cls, value: list[str]) -> list[str]:
            for peer in value:
                host_port(peer)
            return value

        @model_validator(mode="after")
        def _a_role(self) -> NixlPeerBackend.Settings:
            if self.listen is None and not self.peers:
                raise ValueError("set `listen` (serve pages: a producer), `peers` (pull them: a consumer), or both")
            return self

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._agent: NixlAgent | None = None
        self._agent_lock = threading.Lock()  # one NIXL call at a time
        self._arena: PageArena | None = None
        self._arena_registration: Any = None
        self._stop_prefault = threading.Event()
        self._server: PeerServer | None = None
        self._peers = [_Peer(host_port(p)) for p in self.settings.peers]
        #: Where the producer listens, once open (``listen`` with port 0 gets a free port).
        self.address: tuple[str, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def _open(self) -> None:
        await anyio.to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        agent = NixlAgent(self.kind, {"UCX": {}}, progress_thread=True)
        try:
            if self.settings.listen is not None:
                arena = PageArena(self.settings.capacity, self.settings.lease_s)
                self._arena_registration = agent.register([(arena.base, arena.capacity, 0)], "DRAM")
                hello = wire.encode_hello(agent.metadata(), arena.base, arena.capacity)
                host, port = host_port(self.settings.listen)
                self._server = PeerServer(
                    arena, hello, host, port, max_clients=self.settings.max_clients, idle_s=self.settings.idle_s
                )
                self._arena = arena
                self.address = self._server.address
                if self.settings.prefault:
                    self._stop_prefault.clear()
                    populate_in_background(torch.from_numpy(arena.buffer), self._stop_prefault, "nixl-peer-arena")
        except BaseException:
            if self._arena_registration is not None:
                agent.deregister(self._arena_registration)
                self._arena_registration = None
            agent.close()
            raise
        self._agent = agent

    async def _aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._close_sync)

    def _close_sync(self) -> None:
        self._stop_prefault.set()
        if self._server is not None:
            self._server.stop()
            self._server = None
        for peer in self._peers:
            with peer.lock:
                self._disconnect(peer)
        with self._agent_lock:
            agent, self._agent = self._agent, None
            if agent is not None:
                agent.deregister(self._arena_registration)
                agent.close()
        self._arena_registration = None
        self._arena = None

    @property
    def writable(self) -> bool:
        """A consumer without ``listen`` stores nothing: the cache writes it nothing, promises it nothing."""
        return self.settings.listen is not None

    def _usage(self) -> tuple[int | None, int | None, int | None]:
        arena = self._arena
        if arena is None:
            return None, None, None
        return arena.used, arena.capacity, len(arena)

    # -- verbs ----------------------------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        return await anyio.to_thread.run_sync(self._exists_sync, list(keys), abandon_on_cancel=True)

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await anyio.to_thread.run_sync(self._get_sync, list(keys), into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await anyio.to_thread.run_sync(self._get_sync, list(keys), into, sizes)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        arena = self._arena
        if arena is None:
            return 0  # a consumer only: nothing is stored here (see the module docstring)
        before = arena.evicted
        done = await anyio.to_thread.run_sync(arena.store, keys, pages)
        self.evicted_pages += arena.evicted - before
        return done

    async def _delete(self, keys: Sequence[bytes]) -> None:
        if self._arena is not None:
            self._arena.delete(keys)
        if self._peers:
            await anyio.to_thread.run_sync(self._delete_remote, list(keys), abandon_on_cancel=True)

    async def _clear(self) -> None:
        if self._arena is not None:
            self._arena.clear()

    # -- thread side ------------------------------------------------------------------------------------

    def _exists_sync(self, keys: list[bytes]) -> int:
        return self._each_source(keys, lambda part, peer: self._count(part, peer))

    def _get_sync(self, keys: list[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        def read(start: int, peer: _Peer | None) -> int:
            part_sizes = None if sizes is None else [0] * (len(keys) - start)
            if peer is None:
                assert self._arena is not None
                n = self._arena.read(keys[start:], into[start:], part_sizes)
            else:
                n = self._pull(peer, keys[start:], into[start:], part_sizes)
            if sizes is not None and part_sizes is not None:
                sizes[start : start + n] = part_sizes[:n]
            return n

        return self._each_source(keys, lambda start, peer: read(start, peer), by_index=True)

    def _each_source(self, keys: list[bytes], take: Any, *, by_index: bool = False) -> int:
        """Consecutive pages from the start, each run from the first source that has the next page
        (this process's arena, then the peers in order); ``PeerFailed`` of a peer is raised only
        when no page was found at all."""
        done, failures = 0, []
        while done < len(keys):
            n = 0
            if self._arena is not None:
                n = take(done if by_index else keys[done:], None)
            for peer in self._peers if n == 0 else ():
                if time.monotonic() < peer.down_until:
                    continue
                try:
                    n = take(done if by_index else keys[done:], peer)
                except PeerDown:
                    continue
                except PeerFailed as exc:
                    failures.append(f"{peer}: {exc}")
                    continue
                if n:
                    break
            if n == 0:
                break
            done += n
        if done == 0 and failures:
            raise StorageBackendError(self.kind, "read", "; ".join(failures))
        return done

    def _count(self, keys: list[bytes], peer: _Peer | None) -> int:
        if peer is None:
            assert self._arena is not None
            return self._arena.count(keys)
        _, pages = wire.decode_located(self._ask(peer, wire.LOCATE, wire.encode_keys(keys)), peer.arena_bytes, len(keys))
        return len(pages)

    def _pull(self, peer: _Peer, keys: list[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        """Locate pages at ``peer`` under a lease, read those that fit in one UCX READ, release."""
        lease_id, pages = wire.decode_located(
            self._ask(peer, wire.LOCATE, wire.encode_keys(keys, lease=True)), peer.arena_bytes, len(keys)
        )
        try:
            n = 0
            while n < len(pages) and fits(pages[n].size, into[n].nbytes, sizes):
                n += 1
            # One READ for the batch; in parts of about PART_BYTES when the caller checks pages as
            # they land (PageIO.landed), so the first parts are checked while the next ones move.
            split = any(io.landed is not None for io in into[:n])
            parts: list[tuple[list[Region], list[Region], int, int]] = []
            part_bytes = 0
            for i, (page, io) in enumerate(zip(pages[:n], into[:n], strict=True)):
                if not parts or (split and part_bytes >= PART_BYTES):
                    parts.append(([], [], i, i))
                    part_bytes = 0
                local, remote, first, _ = parts[-1]
                local += regions_of(io.buffers(), page.size)
                remote += [(peer.arena_address + offset, length, 0) for offset, length in page.spans]
                parts[-1] = (local, remote, first, i + 1)
                part_bytes += page.size
            if n:
                try:
                    self._read_remote(peer, parts, into)
                except PeerFailed:
                    lease_id = 0  # the peer is down: its lease ends by itself
                    with peer.lock:
                        self._disconnect(peer)  # its agent is met again (new metadata) when it is back
                    raise
            if sizes is not None:
                sizes[:n] = [p.size for p in pages[:n]]
            return n
        finally:
            if lease_id:
                try:
                    self._ask(peer, wire.RELEASE, lease_id.to_bytes(8, "little"))
                except PeerFailed:  # PeerDown included
                    pass  # the lease ends by itself after lease_s

    def _read_remote(
        self, peer: _Peer, parts: list[tuple[list[Region], list[Region], int, int]], into: Sequence[PageIO]
    ) -> None:
        """READ each part (local regions, remote regions, its pages ``first..end``) in turn, the
        destination registered once, and report each part's pages landed as soon as it is in."""
        with self._agent_lock:
            agent = self._agent
            if agent is None or peer.agent_name is None:
                raise PeerFailed("the backend is closed")
            registration = agent.register(list(dict.fromkeys(r for part in parts for r in part[0])), "DRAM")
            try:
                deadline = time.monotonic() + self.settings.timeout_s
                for local, remote, first, end in parts:
                    rows_l, rows_r = pair(local, remote)
                    agent.run("READ", rows_l, rows_r, peer.agent_name, deadline_s=max(0.0, deadline - time.monotonic()))
                    for io in into[first:end]:
                        if io.landed is not None:
                            io.landed()
            except TransferFailed as exc:
                self._fail(peer, exc)
                raise PeerFailed(str(exc)) from exc
            finally:
                agent.deregister(registration)

    def _delete_remote(self, keys: list[bytes]) -> None:
        for peer in self._peers:
            if time.monotonic() < peer.down_until:
                continue
            try:
                self._ask(peer, wire.DELETE, wire.encode_keys(keys))
            except PeerFailed as exc:
                log.debug("nixl-peer: delete at %s failed: %s", peer, exc)

    # -- connections ------------------------------------------------------------------------------------

    def _ask(self, peer: _Peer, op: bytes, body: bytes) -> bytes:
        """One request and its answer; a connection that went stale is made again once."""
        with peer.lock:
            if time.monotonic() < peer.down_until:  # it failed while this call waited for the lock
                raise PeerDown(str(peer))
            for attempt in (0, 1):
                fresh = peer.sock is None
                try:
                    if fresh:
                        self._connect(peer)
                    assert peer.sock is not None
                    wire.send_frame(peer.sock, op, body)
                    got, answer = wire.recv_frame(peer.sock)
                except (OSError, wire.WireError) as exc:
                    self._disconnect(peer)
                    if fresh or attempt:
                        self._fail(peer, exc)
                        raise PeerFailed(f"{type(exc).__name__}: {exc}") from exc
                    continue  # the producer closed an idle connection: once more on a new one
                if got != wire.OK:
                    self._disconnect(peer)
                    self._fail(peer, answer)
                    raise PeerFailed(f"the peer refused the request: {answer[:200]!r}")
                return answer
        raise AssertionError("unreachable")

    def _connect(self, peer: _Peer) -> None:
        sock = socket.create_connection(peer.address, timeout=self.settings.connect_timeout_s)
        try:
            sock.settimeout(self.settings.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            wire.send_frame(sock, wire.HELLO)
            got, body = wire.recv_frame(sock)
            if got != wire.OK:
                raise wire.WireError(f"HELLO refused: {body[:200]!r}")
            metadata, address, size = wire.decode_hello(body)
            with self._agent_lock:
                if self._agent is None:
                    raise wire.WireError("the backend is closed")
                name = self._agent.add_remote(metadata)
        except BaseException:
            sock.close()
            raise
        peer.sock, peer.agent_name, peer.arena_address, peer.arena_bytes = sock, name, address, size

    def _disconnect(self, peer: _Peer) -> None:
        if peer.sock is not None:
            peer.sock.close()
            peer.sock = None
        if peer.agent_name is not None:
            with self._agent_lock:
                if self._agent is not None:
                    self._agent.remove_remote(peer.agent_name)
            peer.agent_name = None

    def _fail(self, peer: _Peer, why: object) -> None:
        peer.down_until = time.monotonic() + self.settings.retry_s
        log.warning("nixl-peer: producer %s failed (%s); its pages are misses for %.0fs", peer, why, self.settings.retry_s)
