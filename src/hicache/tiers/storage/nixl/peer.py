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
      listen: 10.0.0.5:7400      # not loopback: needs peer_token (or the config's tenant_key)
      peer_token: ${HICACHE_NIXL_PEER_TOKEN}
      capacity: 8GiB             # the registered arena the pages live in (LRU-evicted)
    - kind: nixl-peer            # the decode server: pull from these producers
      peers: [10.0.0.5:7400]
      peer_token: ${HICACHE_NIXL_PEER_TOKEN}

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

**Bounded, and a producer gone is a miss.** Every call ends within ``timeout_s``: one deadline for
all its exchanges (the lock on a peer's connection, connecting, which also waits at most
``connect_timeout_s``, each frame, each transfer), the socket cut at it, and a call cancelled is
cut at once. A peer that fails (refused, reset, silent, dripping, a transfer error) is skipped for
``retry_s``, during which its pages are plain misses; the call that saw the failure raises
``StorageBackendError`` when nothing else answered, which the tier counts and turns into a miss. A
read is never left running into the caller's memory: a cancelled call returns once its worker
thread ended (the transfer done or cancelled).

**Trust.** Producer and consumers authenticate each other before anything is revealed
(``peer_auth``: a challenge-response on ``peer_token``, or a key derived from ``tenant_key``); a
producer refuses to listen beyond loopback without such a secret, and a consumer to ask a peer
beyond it. An authenticated consumer can still read and (NIXL registers memory for remote READ and
WRITE alike, with no way to ask for less) write the whole arena over UCX: a tenant key's page MACs
catch a page rewritten, a checksum does not. What a consumer reads is verified by the tier; what
a producer is told is checked (``peer_wire``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import anyio
import torch
from pydantic import Field, SecretStr, field_validator, model_validator

from ....config import MIN_TENANT_KEY_CHARS, SECRET_MASK, ByteSize
from ....errors import ConfigError, StorageBackendError
from ....keys import TenantKey
from ...prefault import populate_in_background
from ..base import BackendSettings, PageIO, StorageBackend, fits
from . import peer_auth
from . import peer_wire as wire
from .agent import NixlAgent, Region, TransferFailed, pair, regions_of
from .peer_arena import PageArena
from .peer_calls import Call, Cancelled, Peer, PeerDown, PeerFailed, acquire, host_port, loopback
from .peer_server import PeerServer

__all__ = ["NixlPeerBackend"]

log = logging.getLogger(__name__)

#: Bytes per UCX READ when the caller checks pages as they land: small enough that checking the
#: first part overlaps most of the batch's transfer, large enough that a READ's set-up (tens of
#: microseconds) is small against moving it (~3 ms at 5 GB/s).
PART_BYTES = 16 * 2**20
#: A call's own deadline, as a share of ``timeout_s``: it ends (and marks a slow peer down) just
#: before the call's ``timeout_s`` cancels it (a cancel marks no peer down: it may be the caller's).
DEADLINE_SHARE = 0.9
#: How long a cancelled call waits for its worker thread, past which it is logged and left.
CANCEL_WAIT_S = 5.0

class NixlPeerBackend(StorageBackend):
    kind = "nixl-peer"
    variable_size_pages = True
    #: The composition root hands it the config's tenant key (``containers.py``): its peer secret
    #: derives from it when ``peer_token`` is not set.
    takes_tenant_key: ClassVar[bool] = True

    class Settings(BackendSettings):
        #: Serve the pages stored here on ``host:port`` (port 0: any free port; see ``address``).
        #: Beyond loopback only with a secret (``peer_token``, or the config's ``tenant_key``).
        listen: str | None = None
        #: Producers to pull from, ``host:port`` each, asked in order.
        peers: list[str] = Field(default_factory=list)
        #: The secret a producer and its consumers share (at least 16 characters): each side proves
        #: it holds it before the other reveals anything. Unset: derived from the config's
        #: ``tenant_key`` if it has one, else none (loopback only).
        peer_token: SecretStr | None = None
        #: Bytes of the producer's registered arena (the pages it serves, least recently used evicted).
        capacity: ByteSize = 1024**3
        connect_timeout_s: float = Field(default=2.0, gt=0)
        #: A peer that failed is not asked again for this long (its pages are misses meanwhile).
        retry_s: float = Field(default=5.0, ge=0)
        #: How long a consumer's read holds the pages it located (released as soon as it is done).
        lease_s: float = Field(default=30.0, gt=0)
        #: The share of ``capacity`` all leases may hold at once (past it the oldest is revoked), so
        #: readers never keep the producer from storing.
        lease_share: float = Field(default=0.5, gt=0, le=0.9)
        #: Leases one consumer connection may hold at once (past it its oldest is revoked).
        leases_per_client: int = Field(default=16, ge=1)
        #: Connections the producer keeps at once (one more closes the oldest unauthenticated or the
        #: longest idle, if any).
        max_clients: int = Field(default=64, ge=1)
        #: A connection that has not authenticated within this long is closed by the producer.
        auth_timeout_s: float = Field(default=3.0, gt=0)
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

        @field_validator("peer_token", mode="before")
        @classmethod
        def _token_text(cls, value: object) -> object:
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if value is None or value == "":
                return None  # ``${HICACHE_NIXL_PEER_TOKEN:-}`` unset: no token
            if not isinstance(value, str):
                raise ValueError("must be a string (quote it in YAML); the value is not shown")
            if value == SECRET_MASK:
                raise ValueError("is the mask hicache prints in place of a secret, not a token: set the real one")
            if len(value) < MIN_TENANT_KEY_CHARS:
                raise ValueError(
                    f"must be at least {MIN_TENANT_KEY_CHARS} characters (the value is not shown); make one with "
                    "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
                )
            return value

        @model_validator(mode="after")
        def _a_role(self) -> NixlPeerBackend.Settings:
            if self.listen is None and not self.peers:
                raise ValueError("set `listen` (serve pages: a producer), `peers` (pull them: a consumer), or both")
            return self

    settings: Settings

    def __init__(self, *, tenant_key: TenantKey | None = None, **options: Any) -> None:
        super().__init__(**options)
        token = self.settings.peer_token
        self._key, secret = peer_auth.peer_key(
            None if token is None else token.get_secret_value(),
            None if tenant_key is None else tenant_key.derive(peer_auth.TENANT_PURPOSE),
        )
        if not secret:
            beyond = [a for a in ([self.settings.listen] if self.settings.listen else []) + self.settings.peers
                      if not loopback(host_port(a)[0])]
            if beyond:
                raise ConfigError(
                    f"storage backend 'nixl-peer': {', '.join(beyond)} is not loopback: set peer_token (the same "
                    "on the producer and its consumers) or the config's tenant_key, or whoever reaches it reads the "
                    "arena"
                )
        self._agent: NixlAgent | None = None
        self._agent_lock = threading.Lock()  # one NIXL call at a time
        self._arena: PageArena | None = None
        self._arena_registration: Any = None
        self._stop_prefault = threading.Event()
        self._server: PeerServer | None = None
        self._peers = [Peer(host_port(p)) for p in self.settings.peers]
        self._live: set[Call] = set()
        self._live_lock = threading.Lock()
        #: Where the producer listens, once open (``listen`` with port 0 gets a free port).
        self.address: tuple[str, int] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------

    async def _open(self) -> None:
        await anyio.to_thread.run_sync(self._open_sync)

    def _open_sync(self) -> None:
        agent = NixlAgent(self.kind, {"UCX": {}}, progress_thread=True)
        s = self.settings
        try:
            if s.listen is not None:
                arena = PageArena(
                    s.capacity, s.lease_s, lease_share=s.lease_share, leases_per_owner=s.leases_per_client
                )
                self._arena_registration = agent.register([(arena.base, arena.capacity, 0)], "DRAM")
                hello = wire.encode_hello(agent.metadata(), arena.base, arena.capacity)
                host, port = host_port(s.listen)
                self._server = PeerServer(
                    arena, hello, host, port, key=self._key, max_clients=s.max_clients, idle_s=s.idle_s,
                    auth_timeout_s=s.auth_timeout_s,
                )
                self._arena = arena
                self.address = self._server.address
                if s.prefault:
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
        """Cut every call in flight (its sockets shut, its transfer's wait ended), then close: the
        calls' threads end at once, so the locks below are had within a bound."""
        self._stop_prefault.set()
        with self._live_lock:
            calls = list(self._live)
        for call in calls:
            call.cancel()
        for peer in self._peers:
            peer.cut()
        if self._server is not None:
            self._server.stop()
            self._server = None
        bound = self.settings.timeout_s + CANCEL_WAIT_S
        for peer in self._peers:
            if peer.lock.acquire(timeout=bound):
                try:
                    self._disconnect(peer)
                finally:
                    peer.lock.release()
            else:
                log.error("nixl-peer: a call on %s did not end within %.0fs of close", peer, bound)
        if not self._agent_lock.acquire(timeout=bound):
            log.error("nixl-peer: a transfer did not end within %.0fs of close; its agent is left open", bound)
            return
        try:
            agent, self._agent = self._agent, None
            if agent is not None:
                agent.deregister(self._arena_registration)
                agent.close()
        finally:
            self._agent_lock.release()
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
        return await self._in_thread(self._exists_sync, list(keys))

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await self._in_thread(self._get_sync, list(keys), into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await self._in_thread(self._get_sync, list(keys), into, sizes)

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
            await self._in_thread(self._delete_remote, list(keys))

    async def _clear(self) -> None:
        if self._arena is not None:
            self._arena.clear()

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(call, *args)`` in a worker thread, under one deadline; cancelled, the call is cut
        (its socket shut, its transfer's wait ended) and waited for, so no thread is left blocked
        and no transfer runs on into the caller's buffers after this returns."""
        call = Call(time.monotonic() + DEADLINE_SHARE * self.settings.timeout_s)

        def run() -> Any:
            try:
                call.start()
                return fn(call, *args)
            finally:
                call.finished.set()

        with self._live_lock:
            self._live.add(call)
        try:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except BaseException:
            if call.cancel():
                with anyio.CancelScope(shield=True):
                    end = time.monotonic() + CANCEL_WAIT_S
                    while not call.finished.is_set() and time.monotonic() < end:
                        await anyio.sleep(0.002)
                if not call.finished.is_set():
                    log.error("nixl-peer: a cancelled call's thread did not end within %.0fs", CANCEL_WAIT_S)
            raise
        finally:
            with self._live_lock:
                self._live.discard(call)

    # -- thread side ------------------------------------------------------------------------------------

    def _exists_sync(self, call: Call, keys: list[bytes]) -> int:
        return self._each_source(call, keys, lambda part, peer: self._count(call, part, peer))

    def _get_sync(self, call: Call, keys: list[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        def read(start: int, peer: Peer | None) -> int:
            part_sizes = None if sizes is None else [0] * (len(keys) - start)
            if peer is None:
                assert self._arena is not None
                n = self._arena.read(keys[start:], into[start:], part_sizes)
            else:
                n = self._pull(call, peer, keys[start:], into[start:], part_sizes)
            if sizes is not None and part_sizes is not None:
                sizes[start : start + n] = part_sizes[:n]
            return n

        return self._each_source(call, keys, lambda start, peer: read(start, peer), by_index=True)

    def _each_source(self, call: Call, keys: list[bytes], take: Any, *, by_index: bool = False) -> int:
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

    def _count(self, call: Call, keys: list[bytes], peer: Peer | None) -> int:
        if peer is None:
            assert self._arena is not None
            return self._arena.count(keys)
        answer = self._ask(call, peer, wire.LOCATE, wire.encode_keys(keys))
        _, pages = wire.decode_located(answer, peer.arena_bytes, len(keys))
        return len(pages)

    def _pull(
        self, call: Call, peer: Peer, keys: list[bytes], into: Sequence[PageIO], sizes: list[int] | None
    ) -> int:
        """Locate pages at ``peer`` under a lease, read those that fit in one UCX READ, release."""
        lease_id, pages = wire.decode_located(
            self._ask(call, peer, wire.LOCATE, wire.encode_keys(keys, lease=True)), peer.arena_bytes, len(keys)
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
                    self._read_remote(call, peer, parts, into)
                except (PeerFailed, Cancelled):
                    lease_id = 0  # it ends with the connection, closed here
                    if peer.lock.acquire(timeout=self.settings.timeout_s):
                        try:
                            self._disconnect(peer)  # its agent is met again (new metadata) when it is back
                        finally:
                            peer.lock.release()
                    raise
            if sizes is not None:
                sizes[:n] = [p.size for p in pages[:n]]
            return n
        finally:
            if lease_id:
                try:
                    self._ask(call, peer, wire.RELEASE, lease_id.to_bytes(8, "little"))
                except (PeerFailed, Cancelled):  # PeerDown included
                    pass  # the lease ends with the connection, or by itself after lease_s

    def _read_remote(
        self, call: Call, peer: Peer, parts: list[tuple[list[Region], list[Region], int, int]],
        into: Sequence[PageIO],
    ) -> None:
        """READ each part (local regions, remote regions, its pages ``first..end``) in turn, the
        destination registered once, and report each part's pages landed as soon as it is in."""
        acquire(self._agent_lock, call, "the NIXL agent")
        try:
            agent = self._agent
            if agent is None or peer.agent_name is None:
                raise PeerFailed("the backend is closed")
            registration = agent.register(list(dict.fromkeys(r for part in parts for r in part[0])), "DRAM")
            try:
                for local, remote, first, end in parts:
                    rows_l, rows_r = pair(local, remote)
                    agent.run("READ", rows_l, rows_r, peer.agent_name, deadline_s=max(0.0, call.left()), stop=call.stop)
                    for io in into[first:end]:
                        if io.landed is not None:
                            io.landed()
            except TransferFailed as exc:
                call.check()  # cancelled: not the peer's fault
                self._fail(peer, exc)
                raise PeerFailed(str(exc)) from exc
            finally:
                agent.deregister(registration)
        finally:
            self._agent_lock.release()

    def _delete_remote(self, call: Call, keys: list[bytes]) -> None:
        for peer in self._peers:
            if time.monotonic() < peer.down_until:
                continue
            try:
                self._ask(call, peer, wire.DELETE, wire.encode_keys(keys))
            except PeerFailed as exc:
                log.debug("nixl-peer: delete at %s failed: %s", peer, exc)

    # -- connections ------------------------------------------------------------------------------------

    def _ask(self, call: Call, peer: Peer, op: bytes, body: bytes) -> bytes:
        """One request and its answer by the call's deadline; a connection that went stale is made
        again once."""
        acquire(peer.lock, call, str(peer))
        try:
            if time.monotonic() < peer.down_until:  # it failed while this call waited for the lock
                raise PeerDown(str(peer))
            for attempt in (0, 1):
                fresh = peer.channel is None
                try:
                    call.check()
                    if fresh:
                        self._connect(call, peer)
                    assert peer.channel is not None
                    call.using(peer)
                    peer.channel.send(op, body, call.deadline)
                    got, answer = peer.channel.recv(call.deadline)
                except (OSError, wire.WireError) as exc:
                    self._disconnect(peer)  # a frame cut short leaves the stream out of step
                    call.check()
                    if fresh or attempt or isinstance(exc, TimeoutError):
                        self._fail(peer, exc)
                        raise PeerFailed(f"{type(exc).__name__}: {exc}") from exc
                    continue  # the producer closed an idle connection: once more on a new one
                finally:
                    call.using(None)
                if got != wire.OK:
                    self._disconnect(peer)
                    self._fail(peer, answer)
                    raise PeerFailed(f"the peer refused the request: {answer[:200]!r}")
                return answer
        finally:
            peer.lock.release()
        raise AssertionError("unreachable")

    def _connect(self, call: Call, peer: Peer) -> None:
        """Connect, authenticate both sides and meet the producer's agent, within ``connect_timeout_s``
        and the call's deadline."""
        deadline = min(call.deadline, time.monotonic() + self.settings.connect_timeout_s)
        if deadline <= time.monotonic():
            raise TimeoutError("no time left to connect")
        sock = socket.create_connection(peer.address, timeout=deadline - time.monotonic())
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            peer.channel = peer_auth.Channel(sock, b"", b"")  # cut-able while the handshake runs
            call.using(peer)
            channel, hello = peer_auth.client_handshake(sock, self._key, deadline)
            metadata, address, size = wire.decode_hello(hello)
            acquire(self._agent_lock, call, "the NIXL agent")
            try:
                if self._agent is None:
                    raise wire.WireError("the backend is closed")
                name = self._agent.add_remote(metadata)
            finally:
                self._agent_lock.release()
        except BaseException:
            peer.channel = None
            sock.close()
            raise
        peer.channel, peer.agent_name, peer.arena_address, peer.arena_bytes = channel, name, address, size

    def _disconnect(self, peer: Peer) -> None:
        """Close the peer's connection and forget its agent (the caller holds ``peer.lock``)."""
        if peer.channel is not None:
            peer.channel.sock.close()
            peer.channel = None
        if peer.agent_name is not None:
            if self._agent_lock.acquire(timeout=self.settings.timeout_s + CANCEL_WAIT_S):
                try:
                    if self._agent is not None:
                        self._agent.remove_remote(peer.agent_name)
                finally:
                    self._agent_lock.release()
            peer.agent_name = None

    def _fail(self, peer: Peer, why: object) -> None:
        peer.down_until = time.monotonic() + self.settings.retry_s
        log.warning(
            "nixl-peer: producer %s failed (%s); its pages are misses for %.0fs", peer, why, self.settings.retry_s
        )
