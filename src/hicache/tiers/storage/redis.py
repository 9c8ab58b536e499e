"""``kind: redis``: pages in a Valkey or Redis server, or spread over a Valkey/Redis Cluster.

One value per page, holding the canonical page format (header + checksum + payload): a page is
stored, replaced or lost whole, so the tier's verification sees either the page or a miss. Reads
and writes of a batch go out as pipelines over pooled connections (``redis.asyncio`` with hiredis
parsing); the two verbs that carry pages, ``GET`` and ``SET``, go in worker threads on redis-py's
blocking pool, straight between the socket and the pages' buffers (``redis_pages.py``; over TLS,
redis-py's pipeline). A key the server lost (evicted under ``maxmemory``, expired by ``ttl_s``, or
gone with a restart) is simply a miss. The server is shared: ``clear`` removes only keys under ``key_prefix``
(matched literally: glob characters in the prefix are escaped), and the password is a secret, never
shown in stats, logs or config dumps.

    tiers:
      storage:
        - kind: redis
          url: redis://127.0.0.1:6379/0        # rediss:// for TLS
          password: ${HICACHE_REDIS_PASSWORD}
          key_prefix: hicache
          ttl_s: 86400

**Cluster** (``cluster: true``; ``url`` names any one node, ``cluster_seeds`` more of them): each
page's key hashes to its own slot (no hash tags, so one prompt's pages spread over every shard, and
a ``key_prefix`` with braces is refused). redis-py's cluster client keeps the slot map, asked of
whichever known node answers (never through ``RedisCluster.initialize()``, which needs the primary
of slot 0 up: see ``_slot_map``); a batch is split per primary and each part goes out as one
pipeline on that node's own connection pool, all parts at once. Why not
``RedisCluster.pipeline()``: with one primary down it failed the whole batch of 30 keys after 3 s
of retries (each of which closes every node's connections; redis-py 8.1, measured), where a cache
wants that node's pages to be misses and the others served at once. A node that answers
``MOVED``/``ASK`` (slots migrated) or cannot be reached makes the next call refresh the slot map
(at most once a second while a node stays down).
``clear`` scans every primary. Set ``cluster-require-full-coverage no`` on the servers, so the other
primaries keep serving while one is down.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from pydantic import Field, SecretStr, model_validator

from ...config import ByteSize
from .base import BackendSettings, PageIO, StorageBackend, StoredPage, fits, scatter
from .lru_index import LruIndex
from .page_format import HEADER_BYTES
from .redis_pages import get_into, set_from

__all__ = ["RedisBackend", "scan_pattern"]

log = logging.getLogger(__name__)

#: Seconds between slot-map refreshes while a node stays unreachable.
_REFRESH_INTERVAL_S = 1.0

#: Bytes the blocking client asks of the socket per read, where its pipeline carries pages (over
#: TLS). Pages go through the blocking pool, in worker threads, because the asyncio client reads
#: 64-256 KiB per event-loop turn and needs the GIL back for each one, and in an engine's process
#: the engine's thread holds the GIL most of the time (one process, a thread burning Python beside
#: the calls: asyncio GET 0.15-0.18 GB/s, the blocking client reading 2 MiB at a time 0.8 GB/s,
#: straight into the buffers 1.3-1.4; quiet 0.9, 2.3-2.5, 2.6-3.0).
_READ_CHUNK = 2 << 20


def scan_pattern(prefix: bytes) -> bytes:
    """A ``SCAN MATCH`` pattern for the keys that start with ``prefix``, literally."""
    return re.sub(rb"([\\*?\[\]])", rb"\\\1", prefix) + b"*"


class RedisBackend(StorageBackend):
    kind = "redis"
    can_list = True
    variable_size_pages = True
    #: Pages per pipeline: 32 pages of a few MiB keep one round trip well under the server's limits.
    max_batch = 32

    class Settings(BackendSettings):
        url_schemes = ("redis", "rediss", "unix")  # what redis-py's from_url accepts
        url: str = "redis://127.0.0.1:6379/0"
        username: str | None = None
        password: SecretStr | None = None
        key_prefix: str = Field(default="hicache", min_length=1)
        # Bytes of pages this process keeps there, least recently used evicted first (None: leave
        # it to the server's own maxmemory policy).
        capacity: ByteSize | None = None
        ttl_s: int | None = Field(default=None, gt=0)  # expire pages after this long (None: never)
        # per server (per node in a cluster), for each of the two pools: pages' GET/SET, everything else
        max_connections: int = Field(default=8, ge=1)
        connect_timeout_s: float = Field(default=2.0, gt=0)
        tls_ca_file: str | None = None  # with a rediss:// url
        tls_cert_file: str | None = None
        tls_key_file: str | None = None
        cluster: bool = False  # url is one node of a Valkey/Redis Cluster
        cluster_seeds: list[str] = Field(default_factory=list)  # more "host:port" nodes to discover it from

        @model_validator(mode="after")
        def _cluster_keys_spread(self) -> RedisBackend.Settings:
            if self.cluster and "{" in self.key_prefix and "}" in self.key_prefix:
                raise ValueError("a cluster key_prefix cannot hold a {hash tag}: it would put every page on one shard")
            if self.cluster_seeds and not self.cluster:
                raise ValueError("cluster_seeds needs cluster: true")
            for seed in self.cluster_seeds:
                host, _, port = seed.rpartition(":")
                if not host or not port.isdigit():
                    raise ValueError(f"a cluster seed is 'host:port', got {seed!r}")
            return self

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._client: Any = None  # one server: its client; a cluster: the cluster client (slot map)
        self._nodes: dict[str, Any] = {}  # a cluster: node name -> that node's own client
        # node name ("server" for one server) -> (blocking client, its threads' limiter): pages' GET/SET
        self._blocking: dict[str, tuple[Any, anyio.CapacityLimiter]] = {}
        self._blocking_options: dict[str, Any] = {}
        # GET replies received straight into the pages (redis_pages.py): not through TLS
        self._direct = not self.settings.url.startswith("rediss://")
        self._options: dict[str, Any] = {}
        self._refresh_at: float | None = None  # a cluster: refresh the slot map from this time on
        self._mapped = False  # a cluster: the slot map has been discovered once
        self._prefix = f"{self.settings.key_prefix}:".encode()
        self._index = LruIndex(self.settings.capacity)  # the pages this process knows are there
        self._staging = bytearray()  # values of the set in flight (see _stage)
        self._set_lock = anyio.Lock()

    def _key(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    # -- lifecycle ------------------------------------------------------------------------------

    async def _open(self) -> None:
        import redis as blocking
        import redis.asyncio as redis  # an optional dependency: `pip install hicache[redis]`
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError
        from redis.retry import Retry as BlockingRetry

        s = self.settings
        self._options = {
            "max_connections": s.max_connections,
            "socket_timeout": s.timeout_s,
            "socket_connect_timeout": s.connect_timeout_s,
            "username": s.username,
            "password": (s.password.get_secret_value() or None) if s.password is not None else None,
            # One immediate retry (a pooled connection the server closed), no backoff sleeps: a
            # server that is down must cost a miss, not seconds of waiting.
            "retry": Retry(NoBackoff(), 1),
        }
        if s.url.startswith("rediss://"):
            self._options |= {"ssl_ca_certs": s.tls_ca_file, "ssl_certfile": s.tls_cert_file,
                              "ssl_keyfile": s.tls_key_file}
        # The blocking client retries only a broken pooled connection: a read that timed out
        # is not tried again (the call is bounded by timeout_s, and it runs to its end in its thread).
        self._blocking_options = self._options | {
            "retry": BlockingRetry(NoBackoff(), 1, supported_errors=(ConnectionError,)),
            "socket_read_size": _READ_CHUNK,
        }
        # No round trip here: a server that is down now is a miss per call, and is used again
        # once it answers, without restarting the cache.
        if not s.cluster:
            self._client = redis.Redis.from_url(s.url, **self._options)
            self._blocking["server"] = (blocking.Redis.from_url(s.url, **self._blocking_options),
                                        anyio.CapacityLimiter(s.max_connections))
            return
        from redis.asyncio.cluster import ClusterNode, RedisCluster

        seeds = [ClusterNode(host, int(port)) for host, _, port in (seed.rpartition(":") for seed in s.cluster_seeds)]
        options = {k: v for k, v in self._options.items() if k != "retry"}
        self._client = RedisCluster.from_url(s.url, startup_nodes=seeds or None, require_full_coverage=False,
                                             **options)

    async def _aclose(self) -> None:
        client, self._client = self._client, None
        nodes, self._nodes = self._nodes, {}
        blocking, self._blocking = self._blocking, {}
        for sync_client, _ in blocking.values():
            sync_client.close()
        for node in nodes.values():
            await node.aclose()
        if client is not None and self.settings.cluster:
            # The client was never initialize()d (see _slot_map), so its aclose() would do nothing:
            # close the connections its slot-map queries opened.
            self._mapped = False
            await client.nodes_manager.aclose()
            await client.nodes_manager.aclose("startup_nodes")
        elif client is not None:
            await client.aclose()

    # -- routing: one pipeline per server ---------------------------------------------------------

    async def _route(self, names: Sequence[bytes]) -> tuple[dict[str, tuple[Any, list[int]]], list[object]]:
        """``({node: (client, indices)}, results)``: where each name goes; a name no node serves
        gets its error in ``results`` already."""
        results: list[object] = [None] * len(names)
        if not self.settings.cluster:
            return {"server": (self._client, list(range(len(names))))}, results
        cluster = await self._slot_map()
        groups: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            try:
                node = cluster.get_node_from_key(name)
            except Exception as exc:  # SlotNotCoveredError: the slot map lost this slot
                results[i] = exc
                self._refresh_soon()
                continue
            if node.name not in groups:
                groups[node.name] = (self._node_client(node), [])
            groups[node.name][1].append(i)
        return groups, results

    async def _slot_map(self) -> Any:
        """The cluster client, its slot map discovered (first call) or refreshed (when due).

        Only the slot map, asked of each known node in turn (``CLUSTER SLOTS``): not
        ``RedisCluster.initialize()``, which also sends ``COMMAND`` to the primary of slot 0 and fails
        as long as that one node is down, so a fresh process would get nothing from the live ones.
        A refresh that fails keeps the map it had (the dead node's pages stay misses meanwhile).
        """
        cluster = self._client
        due = self._refresh_at is not None and time.monotonic() >= self._refresh_at
        if self._mapped and not due:
            return cluster
        self._refresh_at = None
        try:
            await cluster.nodes_manager.initialize()
        except Exception:
            if not self._mapped:
                raise  # no map at all: nothing can be routed, the call fails (and the next one tries again)
            self._refresh_soon()
            log.debug("redis cluster: slot map refresh failed; keeping the one we have", exc_info=True)
        else:
            self._mapped = True
        return cluster

    def _node_client(self, node: Any) -> Any:
        client = self._nodes.get(node.name)
        if client is None:
            import redis as blocking
            import redis.asyncio as redis

            tls = {"ssl": True} if self.settings.url.startswith("rediss://") else {}
            client = self._nodes[node.name] = redis.Redis(host=node.host, port=node.port, **self._options, **tls)
            self._blocking[node.name] = (
                blocking.Redis(host=node.host, port=node.port, **self._blocking_options, **tls),
                anyio.CapacityLimiter(self.settings.max_connections),
            )
        return client

    def _refresh_soon(self, now: bool = False) -> None:
        at = time.monotonic() + (0 if now else _REFRESH_INTERVAL_S)
        self._refresh_at = at if self._refresh_at is None else min(self._refresh_at, at)

    async def _pipelined(self, names: Sequence[bytes], command: Callable[[Any, int], None] | None = None, *,
                         blocking: Callable[[Any, list[int]], list[object]] | None = None) -> list[object]:
        """``command(pipe, i)`` queues the command for ``names[i]``; one pipeline per node, all at
        once. Each name's reply, or the exception that stood in its way. ``blocking(client,
        indices)`` instead: the replies of a node's names through its blocking client, in a worker
        thread (pages' values: see ``_READ_CHUNK``); the call then runs to its end even when
        cancelled (the buffers it reads or sends are the caller's), bounded by the socket timeout."""
        from redis.exceptions import AskError, ConnectionError, TimeoutError

        groups, results = await self._route(names)

        async def run(node: str, client: Any, indices: list[int]) -> None:
            try:
                if blocking is not None:
                    sync_client, limiter = self._blocking[node]
                    replies = await anyio.to_thread.run_sync(blocking, sync_client, indices, limiter=limiter)
                else:
                    assert command is not None
                    async with client.pipeline(transaction=False) as pipe:
                        for i in indices:
                            command(pipe, i)
                        replies = await pipe.execute(raise_on_error=False)
            except Exception as exc:  # the node is unreachable (or the pipeline broke): all its names
                replies = [exc] * len(indices)
            for i, reply in zip(indices, replies, strict=True):
                results[i] = reply
                if isinstance(reply, AskError):  # MOVED too: the slots moved
                    self._refresh_soon(now=True)
                elif isinstance(reply, (ConnectionError, TimeoutError)) and self.settings.cluster:
                    self._refresh_soon()

        if len(groups) == 1:
            ((node, (client, indices)),) = groups.items()
            await run(node, client, indices)
        else:
            async with anyio.create_task_group() as tg:
                for node, (client, indices) in groups.items():
                    tg.start_soon(run, node, client, indices)
        return results

    @staticmethod
    def _pipeline(command: Callable[[Any, int], None]) -> Callable[[Any, list[int]], list[object]]:
        """A ``blocking`` for ``_pipelined``: ``command`` for each of the indices, one pipeline."""

        def execute(client: Any, indices: list[int]) -> list[object]:
            with client.pipeline(transaction=False) as pipe:
                for i in indices:
                    command(pipe, i)
                return pipe.execute(raise_on_error=False)  # type: ignore[no-any-return]

        return execute

    def _leading(self, results: Sequence[object], ok: Callable[[object], bool], verb: str) -> int:
        """How many results from the first are ``ok``. The error that ended them is raised when it
        is the first (nothing to show for the call), else counted and logged: in a cluster the pages
        before it, on other nodes, are still of use."""
        n = 0
        for r in results:
            if isinstance(r, BaseException) or not ok(r):
                break
            n += 1
        if n < len(results) and isinstance(results[n], BaseException):
            exc = results[n]
            if n == 0:
                raise exc
            self._errors += 1
            log.debug("redis %s: %d of %d pages, then %r", verb, n, len(results), exc)
        return n

    # -- the three operations -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        names = [self._key(k) for k in keys]
        found = await self._pipelined(names, lambda pipe, i: pipe.exists(names[i]))
        n = self._leading(found, bool, "exists")
        if n < len(keys):
            self._index.forget(keys[n])
        return n

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await self._read(keys, into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await self._read(keys, into, sizes)

    async def _read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        names = [self._key(k) for k in keys]
        if self._direct:  # each value received into its page (an int: its length), or None
            timeout_s = self.settings.timeout_s

            def receive(client: Any, indices: list[int]) -> list[object]:
                return get_into(client, [names[i] for i in indices], [into[i] for i in indices],
                                sizes is not None, timeout_s)

            values = await self._pipelined(names, blocking=receive)
        else:  # bytes each, or None
            values = await self._pipelined(names, blocking=self._pipeline(lambda pipe, i: pipe.get(names[i])))
        # A value that is lost, or not a page of this size, is a miss from there on.
        n = self._leading(values, lambda blob: blob is not None, "get")
        for i in range(n):
            blob, io = values[i], into[i]
            size = blob if isinstance(blob, int) else len(blob)  # type: ignore[arg-type]
            if not fits(size, io.nbytes, sizes):
                n = i
                break
            if not isinstance(blob, int):
                scatter(blob, io)
            if sizes is not None:
                sizes[i] = size
            self._index.remember(keys[i], size)
        if n < len(keys):
            self._index.forget(keys[n])
        return n

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        ttl = self.settings.ttl_s
        fits, victims = self._index.plan(keys, [io.nbytes for io in pages])
        async with self._set_lock:
            if victims:
                # One UNLINK per key: a cluster refuses multi-key commands across slots.
                gone = [self._key(k) for k in victims]
                await self._pipelined(gone, lambda pipe, i: pipe.unlink(gone[i]))
                for key in victims:
                    self._index.forget(key)
                self.evicted_pages += len(victims)
            names = [self._key(k) for k in keys[:fits]]
            if self._direct:  # sent from the pages' own buffers
                timeout_s = self.settings.timeout_s
                batch = pages[:fits]

                def send(client: Any, indices: list[int]) -> list[object]:
                    return set_from(client, [names[i] for i in indices], [batch[i] for i in indices], ttl, timeout_s)

                results = await self._pipelined(names, blocking=send)
            else:
                values = self._stage(pages[:fits])
                # The transport sends or copies every value before execute() returns: the staging
                # buffer is free again for the next call.
                results = await self._pipelined(
                    names, blocking=self._pipeline(lambda pipe, i: pipe.set(names[i], values[i], ex=ttl)))
        done = self._leading(results, lambda ok: ok is True, "set")
        for key, io in zip(keys[:done], pages[:done], strict=True):
            self._index.remember(key, io.nbytes)
        return done

    def _stage(self, pages: Sequence[PageIO]) -> list[memoryview]:
        """Each page as one contiguous value, in a buffer reused from call to call.

        A value is header + payload, which live apart; joining them into fresh bytes each call
        costs page faults on new memory (about 1.8 ms per 3 MiB page here), a reused buffer does not.
        """
        need = sum(io.nbytes for io in pages)
        if len(self._staging) < need:
            self._staging = bytearray(need)
        view = memoryview(self._staging)
        values, pos = [], 0
        for io in pages:
            start = pos
            for buf in io.buffers():
                view[pos : pos + len(buf)] = buf
                pos += len(buf)
            values.append(view[start:pos])
        return values

    async def _delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        names = [self._key(k) for k in keys]
        if self.settings.cluster:
            results = await self._pipelined(names, lambda pipe, i: pipe.unlink(names[i]))
            failed = next((r for r in results if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        else:
            await self._client.unlink(*names)
        for key in keys:
            self._index.forget(key)

    async def scan_keys(self) -> AsyncIterator[bytes]:
        """The names of every page under ``key_prefix``, from every primary of a cluster."""
        if self.settings.cluster:
            cluster = await self._slot_map()
            clients = [self._node_client(node) for node in cluster.get_primaries()]
        else:
            clients = [self._client]
        for client in clients:
            async for name in client.scan_iter(match=scan_pattern(self._prefix), count=1000):
                yield name

    # -- listing (hicache inspect) --------------------------------------------------------------

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        """Pages under ``key_prefix`` on every primary, 500 at a time, with their sizes (``STRLEN``)
        and last use (``OBJECT IDLETIME``; unknown under an LFU ``maxmemory-policy``)."""
        names: list[bytes] = []
        async for name in self.scan_keys():
            if self._page_key(name) is not None:
                names.append(name)
            if len(names) >= 500:
                yield await self._describe(names)
                names = []
        if names:
            yield await self._describe(names)

    def _page_key(self, name: bytes) -> bytes | None:
        rest = name[len(self._prefix) :]
        if len(rest) != 32:
            return None
        try:
            return bytes.fromhex(rest.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None

    async def _describe(self, names: list[bytes]) -> list[StoredPage]:
        sizes = await self._pipelined(names, lambda pipe, i: pipe.strlen(names[i]))
        idle = await self._pipelined(names, lambda pipe, i: pipe.object("idletime", names[i]))
        now = time.time()
        out = []
        for name, size, seconds in zip(names, sizes, idle, strict=True):
            key = self._page_key(name)
            if key is None or isinstance(size, BaseException) or not size:
                continue  # gone meanwhile (STRLEN 0), or its node did not answer
            used = now - seconds if isinstance(seconds, int) else None
            out.append(StoredPage(key, int(size), used))  # type: ignore[call-overload]
        return out

    async def _read_headers(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        names = [self._key(p.key) for p in pages]

        async def ranges() -> list[object]:
            return await self._pipelined(names, lambda pipe, i: pipe.getrange(names[i], 0, HEADER_BYTES - 1))

        values = await self._call("get", ranges)
        return [v if isinstance(v, bytes) and len(v) == HEADER_BYTES else None for v in values]

    async def _clear(self) -> None:
        """Remove this prefix's pages only: the server may hold other data."""
        batch: list[bytes] = []

        async def unlink() -> None:
            if self.settings.cluster:  # names of many slots: one UNLINK each, pipelined per node
                results = await self._pipelined(batch, lambda pipe, i: pipe.unlink(batch[i]))
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is not None:
                    raise failed
            else:
                await self._client.unlink(*batch)
            batch.clear()

        async for name in self.scan_keys():
            batch.append(name)
            if len(batch) >= 1000:
                await unlink()
        if batch:
            await unlink()
        self._index.clear()

    def _usage(self) -> tuple[int, int | None, int]:
        """What this process knows is stored (the server may hold more, written by others)."""
        return self._index.used, self.settings.capacity, len(self._index)
