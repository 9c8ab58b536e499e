"""``kind: mooncake``: pages in a Mooncake Store cluster (a master plus the segments clients contribute).

Each page is **one Mooncake object**, ``{key_prefix}/{key hex}``, holding ``header + payload``. The
multi-buffer calls (``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``) gather a
page from, and scatter it into, several buffers, so a page is stored atomically (one object, never a
lost half) without joining it first. Why not two objects per page: a page would then be present only
if both halves are, eviction could take one half, and every call would cost twice the keys.

Zero copy: a payload piece that is a view of a large buffer (a host pool, either layout: one piece
per page for ``page_first``, one per component and layer for ``layer_first``) is read and written in
place once that buffer is registered with the client. The buffer is found through the memoryview's
exporter (the root of a numpy array's ``base`` chain) and registered once, when it is at least
``register_min`` bytes; the backend keeps it alive while registered and unregisters it at close (or
when more than ``max_registered`` buffers were seen). Headers, built per call by the tier, go through
a registered staging arena (128 bytes a page). Pages whose pieces are not in registered memory (small
standalone buffers) are copied once through the same arena.

Threads: the client is blocking and not documented as thread-safe, so its calls run in worker
threads, one at a time (a ``threading.Lock`` inside the thread, so a call abandoned at its timeout
still keeps the next one out until it finishes). ``exists``/``set``/``delete``/``clear`` are
abandoned at ``timeout_s`` (they write nothing into the caller's memory); ``get`` is not (a late
transfer into a host page the cache has since reused would be wrong data), but asks the client's
``health_check`` first, so it fails at once when the master is unreachable.

Faults: when the master dies, calls fail (RPC errors) or time out; the client pings the master and
reconnects by itself once it is back (a second or two). If the client reports itself closed, the
backend sets up a new one. The store is lossy: the master evicts at its high watermark, so a page
stored earlier can read as not found (-704): always a miss, never an error or wrong data. Object data
lives in the segment the master allocated it in (any client's that lends memory; this client's own
first with ``prefer_local_segment``), so it disappears when that process exits.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, TypeVar

import anyio
import numpy as np
from pydantic import BeforeValidator, Field

from ...config import ByteSize, parse_size
from ...errors import ListingUnsupportedError, StorageBackendError
from .base import BackendSettings, PageIO, StorageBackend, StoredPage, fits
from .lru_index import LruIndex
from .page_format import HEADER_BYTES

__all__ = ["MooncakeBackend", "MooncakeError"]

log = logging.getLogger(__name__)

T = TypeVar("T")

OBJECT_NOT_FOUND = -704  # a miss: never stored, removed, or evicted
OBJECT_HAS_LEASE = -706  # remove inside the read lease: not a failure
# A get whose buffers are smaller (-600) or larger (-800) than the object: a foreign page, a miss.
_SIZE_MISMATCH = (-600, -800)
_HEALTHY, _CLOSED, _UNREACHABLE = 0, 1, 2


class MooncakeError(RuntimeError):
    """A Mooncake call returned an error code; the base class reports it as ``StorageBackendError``."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} returned {code}")
        self.code = code


def _key_of(name: str, prefix: str) -> bytes | None:
    rest = name[len(prefix) + 1 :]
    if len(rest) != 32:
        return None
    try:
        return bytes.fromhex(rest)
    except ValueError:
        return None


def _address(buf: memoryview) -> int:
    """The address of a contiguous buffer, writable or not, without copying it."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def _root(buf: memoryview) -> tuple[object, int, int] | None:
    """``(owner, address, nbytes)`` of the whole buffer ``buf`` is a view of, where that can be found."""
    obj = buf.obj
    if isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        if not (obj.flags.c_contiguous or obj.flags.f_contiguous):
            return None
        return obj, int(obj.ctypes.data), int(obj.nbytes)
    try:
        whole = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
    if not whole.contiguous:
        return None
    return obj, _address(whole.cast("B") if whole.ndim != 1 or whole.format != "B" else whole), whole.nbytes


def _trimmed(io: PageIO, size: int) -> PageIO:
    """``io``'s header and the start of its payload pieces: exactly ``size`` bytes in all."""
    left, pieces = size - len(io.header), []
    for piece in io.payload:
        if left <= 0:
            break
        pieces.append(piece[: min(len(piece), left)])
        left -= len(pieces[-1])
    return PageIO(io.header, tuple(pieces))


class MooncakeBackend(StorageBackend):
    kind = "mooncake"
    max_batch = 64
    can_list = True  # through the master's admin port (``admin_url``); the client cannot list
    variable_size_pages = True

    class Settings(BackendSettings):
        master: str = "127.0.0.1:50051"
        metadata_server: str = "http://127.0.0.1:8080/metadata"
        protocol: str = "tcp"
        device_name: str = ""
        local_hostname: str = "127.0.0.1"
        # Memory this client lends the cluster; 0 mounts none (a pure client: pages live in others' segments).
        global_segment_size: Annotated[int, BeforeValidator(lambda v: parse_size(v, minimum=0))] = 512 * 1024**2
        local_buffer_size: ByteSize = 64 * 1024**2
        #: Put pages into this client's own segment when it has room (the master picks another
        #: segment when not): a write is then a copy within this process, and a reader pulls the
        #: page from here; the pages go when this process does. Needs ``global_segment_size`` > 0.
        prefer_local_segment: bool = False
        key_prefix: str = Field(default="hicache", min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$")
        #: Buffers at least this large that payload pieces are views of are registered (zero copy).
        register_min: ByteSize = 16 * 1024**2
        max_registered: int = Field(default=8, ge=1)
        #: Initial size of the registered staging arena (headers, and pages not in registered memory).
        staging_size: ByteSize = 32 * 1024**2
        #: Bytes of pages this process keeps in the cluster, least recently used evicted first (None:
        #: leave it to the master, which evicts at its high watermark).
        capacity: ByteSize | None = None
        #: The master's admin HTTP server (its ``--metrics_port``), e.g. ``http://127.0.0.1:9003``:
        #: only ``hicache inspect`` uses it, to list pages (``/get_all_keys``, ``/batch_query_keys``).
        admin_url: str | None = Field(default=None, pattern=r"^https?://[^/?#]+$")

    settings: Settings

    def __init__(self, **options: object) -> None:
        super().__init__(**options)
        self._store: Any = None
        self._put_config: Any = None  # set with the client (``_placement``)
        self._lock = threading.Lock()  # one client call at a time, abandoned threads included
        self._limiter = anyio.CapacityLimiter(1)
        # address -> (nbytes, owner): buffers registered with the client, least recently used first
        self._registered: OrderedDict[int, tuple[int, object]] = OrderedDict()
        self._staging: np.ndarray | None = None
        self._suspect = False  # the last call failed: check the client's health before the next
        self._index = LruIndex(self.settings.capacity)  # the pages this process knows are there

    # -- lifecycle ------------------------------------------------------------------------------

    def _new_client(self) -> Any:
        try:
            from mooncake.store import MooncakeDistributedStore
        except Exception as exc:  # ImportError, or OSError for a missing shared library
            raise StorageBackendError(
                self.kind, "open", f"cannot import mooncake.store ({exc}); pip install mooncake-transfer-engine-non-cuda"
            ) from exc
        s = self.settings
        store = MooncakeDistributedStore()
        rc = store.setup(
            s.local_hostname, s.metadata_server, s.global_segment_size, s.local_buffer_size,
            s.protocol, s.device_name, s.master,
        )
        if rc != 0:
            raise StorageBackendError(
                self.kind, "open",
                f"client setup returned {rc} (master {s.master}, metadata server {s.metadata_server}): "
                "is mooncake_master running there?",
            )
        self._put_config = self._placement(store)
        return store

    def _placement(self, store: Any) -> Any:
        """The ``ReplicateConfig`` of every put: Mooncake's default, or this client's own segment first."""
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        if self.settings.prefer_local_segment and self.settings.global_segment_size > 0:
            config.preferred_segment = store.get_hostname()  # the segment's name: host:port of this client
        return config

    async def _open(self) -> None:
        self._store = await anyio.to_thread.run_sync(self._new_client, limiter=self._limiter)

    async def _aclose(self) -> None:
        def close() -> None:
            with self._lock:
                store, self._store = self._store, None
                if store is None:
                    return
                for address in list(self._registered):
                    store.unregister_buffer(address)
                self._registered.clear()
                self._staging = None
                store.close()

        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(close, limiter=self._limiter)

    # -- thread-side plumbing -------------------------------------------------------------------

    async def _run(self, fn: Callable[[Any], T], *, abandon: bool = True) -> T:
        """Run ``fn(client)`` in a worker thread under the lock; see the module docstring."""

        def call() -> T:
            # Bounded: a call abandoned at its timeout may still hold the lock (a stalled RPC).
            if not self._lock.acquire(timeout=self.settings.timeout_s):
                raise MooncakeError("waiting for the previous call (still stalled)", -1)
            try:
                store = self._client()
                try:
                    result = fn(store)
                except Exception:
                    self._suspect = True
                    raise
                self._suspect = False
                return result
            finally:
                self._lock.release()

        return await anyio.to_thread.run_sync(call, limiter=self._limiter, abandon_on_cancel=abandon)

    def _client(self) -> Any:
        """The client, after a health check if the last call failed (a new one if it reports closed)."""
        if self._store is None:
            raise StorageBackendError(self.kind, "call", "the client is closed")
        if self._suspect:
            health = self._store.health_check()
            if health == _CLOSED:
                log.warning("mooncake client reports itself closed; setting up a new one")
                self._registered.clear()
                self._staging = None
                self._store = self._new_client()
            elif health != _HEALTHY:
                raise MooncakeError("health_check (master unreachable)", health)
        return self._store

    def _name(self, key: bytes) -> str:
        return f"{self.settings.key_prefix}/{key.hex()}"

    def _registered_span(self, address: int, nbytes: int) -> bool:
        for base, (size, _owner) in self._registered.items():
            if base <= address and address + nbytes <= base + size:
                return True
        return False

    def _register(self, store: Any, owner: object, address: int, nbytes: int) -> None:
        rc = store.register_buffer(address, nbytes)
        if rc != 0:
            raise MooncakeError("register_buffer", rc)
        self._registered[address] = (nbytes, owner)
        while len(self._registered) > self.settings.max_registered + 1:  # +1: the staging arena
            old = next(a for a in self._registered if self._staging is None or a != self._staging.ctypes.data)
            store.unregister_buffer(old)
            del self._registered[old]

    def _in_place(self, store: Any, pieces: Sequence[memoryview]) -> list[int] | None:
        """Addresses of ``pieces`` if all can be used in place (registering their buffer), else ``None``."""
        addresses = []
        for piece in pieces:
            if not piece.contiguous:
                return None
            address = _address(piece)
            if not self._registered_span(address, len(piece)):
                root = _root(piece)
                if root is None or root[2] < self.settings.register_min:
                    return None
                owner, base, size = root
                if not (base <= address and address + len(piece) <= base + size):
                    return None
                self._register(store, owner, base, size)
            addresses.append(address)
        return addresses

    def _arena(self, store: Any, need: int) -> np.ndarray:
        """The registered staging arena, grown (re-registered) to at least ``need`` bytes."""
        if self._staging is None or self._staging.nbytes < need:
            if self._staging is not None:
                old = int(self._staging.ctypes.data)
                store.unregister_buffer(old)
                self._registered.pop(old, None)
                self._staging = None
            size = max(need, self.settings.staging_size)
            arena = np.zeros(size, dtype=np.uint8)
            rc = store.register_buffer(int(arena.ctypes.data), size)
            if rc != 0:
                raise MooncakeError("register_buffer", rc)
            self._staging = arena
            self._registered[int(arena.ctypes.data)] = (size, arena)
        return self._staging

    def _plan(self, store: Any, pages: Sequence[PageIO]) -> tuple[np.ndarray, list[tuple[list[int], list[int], int]]]:
        """Per page ``(addresses, sizes, staging offset)``: in place where possible, else one staged copy.

        The staging offset is where the page (or its header alone) sits in the arena; ``-1`` never
        occurs. The arena is sized for the whole batch up front so it is not regrown mid-batch.
        """
        in_place = [self._in_place(store, io.payload) for io in pages]
        need = sum(HEADER_BYTES if addrs is not None else io.nbytes for io, addrs in zip(pages, in_place, strict=True))
        arena = self._arena(store, need)
        base = int(arena.ctypes.data)
        plan = []
        offset = 0
        for io, addrs in zip(pages, in_place, strict=True):
            if addrs is not None:
                plan.append(([base + offset, *addrs], [HEADER_BYTES, *(len(p) for p in io.payload)], offset))
                offset += HEADER_BYTES
            else:
                plan.append(([base + offset], [io.nbytes], offset))
                offset += io.nbytes
        return arena, plan

    # -- verbs ----------------------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        names = [self._name(k) for k in keys]
        n = await self._run(lambda store: self._present(store, names))
        if n < len(keys):
            self._index.forget(keys[n])
        return n

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        names = [self._name(k) for k in keys]

        # Ask the master first, in a call abandoned at the timeout: this is where a dead master
        # stalls (seconds). The transfer after it is not abandoned (a late write into a host page
        # the cache has reused would be wrong data), and it only runs against a live master.
        present = await self._run(lambda store: self._present(store, names))
        done = 0
        if present:
            done = await self._run(lambda store: self._get_sync(store, names[:present], into[:present]), abandon=False)
        for key, io in zip(keys[:done], into[:done], strict=True):
            self._index.remember(key, io.nbytes)
        if done < len(keys):
            self._index.forget(keys[done])
        return done

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        """Pages of varying size: their sizes from the master first (``get_size``), then one transfer
        of the pages that fit, each into the start of its buffers."""
        names = [self._name(k) for k in keys]
        present = await self._run(lambda store: self._present(store, names))
        found: list[int] = []
        if present:
            found = await self._run(lambda store: [int(store.get_size(n)) for n in names[:present]])
        fit = 0
        while fit < len(found) and fits(found[fit], into[fit].nbytes, sizes):
            fit += 1
        done = 0
        if fit:
            trimmed = [_trimmed(io, size) for io, size in zip(into[:fit], found[:fit], strict=True)]
            done = await self._run(lambda store: self._get_sync(store, names[:fit], trimmed), abandon=False)
        sizes[:done] = found[:done]
        for key, size in zip(keys[:done], found[:done], strict=True):
            self._index.remember(key, size)
        if done < len(keys):
            self._index.forget(keys[done])
        return done

    @staticmethod
    def _present(store: Any, names: list[str]) -> int:
        for i, code in enumerate(store.batch_is_exist(names)):
            if code == 1:
                continue
            if code == 0 or code == OBJECT_NOT_FOUND:
                return i
            raise MooncakeError("batch_is_exist", code)
        return len(names)

    def _get_sync(self, store: Any, names: list[str], into: Sequence[PageIO]) -> int:
        """Read pages known to exist: in place where registered, else through the arena."""
        arena, plan = self._plan(store, into)
        codes = store.batch_get_into_multi_buffers(names, [p[0] for p in plan], [p[1] for p in plan])
        for i, (io, (addrs, _sizes, offset), code) in enumerate(zip(into, plan, codes, strict=True)):
            if code != io.nbytes:
                if code == OBJECT_NOT_FOUND or code in _SIZE_MISMATCH or code >= 0:
                    return i
                if i:  # the pages before it landed; the next call reports the failure
                    return i
                raise MooncakeError("batch_get_into_multi_buffers", code)
            io.header[:] = arena[offset : offset + HEADER_BYTES]
            if len(addrs) == 1:  # staged: scatter the payload into the caller's pieces
                pos = offset + HEADER_BYTES
                for piece in io.payload:
                    piece[:] = arena[pos : pos + len(piece)]
                    pos += len(piece)
        return len(names)

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        fits, victims = self._index.plan(keys, [io.nbytes for io in pages])
        keys, pages = keys[:fits], pages[:fits]
        names = [self._name(k) for k in keys]
        evict = [self._name(k) for k in victims]

        def call(store: Any) -> int:
            if evict:
                store.batch_remove(evict, True)
            arena, plan = self._plan(store, pages)
            for io, (addrs, _sizes, offset) in zip(pages, plan, strict=True):
                arena[offset : offset + HEADER_BYTES] = io.header
                if len(addrs) == 1:  # staged: gather the payload after the header
                    pos = offset + HEADER_BYTES
                    for piece in io.payload:
                        arena[pos : pos + len(piece)] = piece
                        pos += len(piece)
            # A put onto an existing key keeps the old object, so drop it first (forced: past a lease).
            store.batch_remove(names, True)
            codes = store.batch_put_from_multi_buffers(names, [p[0] for p in plan], [p[1] for p in plan],
                                                       self._put_config)
            for i, code in enumerate(codes):
                if code != 0:
                    if i == 0:
                        raise MooncakeError("batch_put_from_multi_buffers", code)
                    return i
            return len(names)

        done = await self._run(call) if keys or evict else 0
        for key in victims:
            self._index.forget(key)
        self.evicted_pages += len(victims)
        for key, io in zip(keys[:done], pages[:done], strict=True):
            self._index.remember(key, io.nbytes)
        return done

    async def _delete(self, keys: Sequence[bytes]) -> None:
        names = [self._name(k) for k in keys]

        def call(store: Any) -> None:
            for code in store.batch_remove(names, True):
                if code not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE):
                    raise MooncakeError("batch_remove", code)

        await self._run(call)
        for key in keys:
            self._index.forget(key)

    async def _clear(self) -> None:
        pattern = f"^{re.escape(self.settings.key_prefix)}/"

        def call(store: Any) -> None:
            code = store.remove_by_regex(pattern, True)
            if code < 0 and code != OBJECT_NOT_FOUND:
                raise MooncakeError("remove_by_regex", code)

        await self._run(call)
        self._index.clear()

    # -- listing (hicache inspect) --------------------------------------------------------------

    @classmethod
    def inspection_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """A reader mounts no segment: it lends the cluster no memory, and takes no pages away when it exits."""
        return {**options, "global_segment_size": 0}

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        """Every object under ``key_prefix/`` as the master lists it, sizes from ``/batch_query_keys``.

        The client has no listing call; the master's admin port has. Mooncake keeps no access
        time, so ``last_used`` is unknown (``inspect purge --older-than`` refuses this tier).
        """
        if self.settings.admin_url is None:
            raise ListingUnsupportedError(
                self.kind, "set admin_url to the master's admin address (its --metrics_port), "
                "e.g. http://127.0.0.1:9003: the Mooncake client itself cannot list objects",
            )
        prefix = f"{self.settings.key_prefix}/"
        text = await anyio.to_thread.run_sync(self._admin_get, "/get_all_keys", abandon_on_cancel=True)
        names = [n for n in text.decode().split() if n.startswith(prefix)]
        for start in range(0, len(names), 200):
            chunk = names[start : start + 200]
            yield await anyio.to_thread.run_sync(self._sizes, chunk, abandon_on_cancel=True)

    def _admin_get(self, path: str) -> bytes:
        import urllib.request

        assert self.settings.admin_url is not None
        with urllib.request.urlopen(self.settings.admin_url + path, timeout=self.settings.timeout_s) as reply:
            return reply.read(256 * 1024**2)

    def _sizes(self, names: list[str]) -> list[StoredPage]:
        import json
        from urllib.parse import quote

        reply = json.loads(self._admin_get("/batch_query_keys?keys=" + quote(",".join(names), safe=",/")))
        found = reply.get("data") or {}
        out = []
        for name in names:
            key = _key_of(name, self.settings.key_prefix)
            entry = found.get(name) or {}
            values = entry.get("values") or []
            if key is None or not entry.get("ok") or not values:
                continue  # removed meanwhile, or not one of our names
            out.append(StoredPage(key, int(values[0].get("size_", 0)) or None, None))
        return out

    def _usage(self) -> tuple[int, int | None, int]:
        """What this process knows is stored (the cluster may hold more, written by others)."""
        return self._index.used, self.settings.capacity, len(self._index)
