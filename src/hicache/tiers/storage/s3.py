"""``kind: s3``: pages as objects in an S3-compatible store (AWS S3, SeaweedFS, MinIO, Ceph RGW, ...).

One object per page, ``{bucket}/{key_prefix}/{2 hex}/{key hex}``, holding the canonical page format
(header + checksum or MAC + payload): an S3 ``PUT`` replaces an object whole, so a reader sees the
old page, the new one or a miss, never half of one. The client is ``obstore`` (Rust ``object_store``
under asyncio), chosen by ``benchmarks/storage_s3.py`` over ``aiobotocore``: on the same bytes
against the same SeaweedFS server, ``GET`` moved about 2x the bytes (medians 1.91-2.08x over three
runs) and ``PUT`` as much or more (0.91-1.58x; the server bounds it).

* ``exists``: one ``HEAD`` per key, ``max_concurrency`` at a time, in key order; the first missing
  key stops the ones not yet sent (keys are chained: nothing after a gap is of use).
* ``get``: one ``GET`` per key, as many at a time; each reply lands in Rust memory and is copied
  once, straight into the page's own buffers (the host pool's memory): there is no API that reads
  an HTTP body into a caller's buffer, and a copy made here, after the await, also means a call
  cancelled at its timeout never writes into a host page the cache has since reused.
* ``set``: each page joined once into a staging buffer reused from call to call (fresh memory
  costs page faults), then ``max_concurrency`` single-part ``PUT``s at a time. A call that fails or
  times out abandons its staging buffer to the requests that may still hold it.

Every call is bounded by ``timeout_s`` twice: by the client (each request, no retries past it) and
by the base class (the whole batch). A store that is down is a miss per call, counted, and is used
again once it answers. Wrong credentials are counted failures (``403``), never a crash.

Secrets (``access_key_id``, ``secret_access_key``, ``session_token``) are ``SecretStr``: never in a
repr, a log or a config dump. Without ``access_key_id`` they are all read from ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY`` and ``AWS_SESSION_TOKEN`` when the backend opens (never a key from one
place and a token from the other). Without any the backend refuses to open (``ConfigError``): it
never falls back to instance-metadata lookups. An entry sent to the admin endpoint must carry its
own credentials: it reads nothing from this process's environment (``settings_environ``), or a
request could have the server sign requests to an endpoint it names with the server's identity.

    tiers:
      storage:
        - kind: s3
          endpoint_url: http://127.0.0.1:8333     # omit for AWS itself
          bucket: hicache
          region: us-east-1
          key_prefix: prod-llama
          access_key_id: ${HICACHE_S3_ACCESS_KEY_ID}
          secret_access_key: ${HICACHE_S3_SECRET_ACCESS_KEY}
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import timedelta
from typing import Any

import anyio
from pydantic import Field, SecretStr, ValidationInfo, model_validator

from ...config import ByteSize
from ...errors import ConfigError
from .base import BackendSettings, PageIO, StorageBackend, StoredPage, fits, scatter, settings_environ
from .lru_index import LruIndex
from .page_format import HEADER_BYTES

__all__ = ["S3Backend"]

log = logging.getLogger(__name__)

_ENV = {"access_key_id": "AWS_ACCESS_KEY_ID", "secret_access_key": "AWS_SECRET_ACCESS_KEY",
        "session_token": "AWS_SESSION_TOKEN"}
_MISSING = object()  # a key the store does not hold


class S3Backend(StorageBackend):
    kind = "s3"
    can_list = True
    variable_size_pages = True
    #: Pages per batch: 16 pages of a few MiB keep one batch well inside ``timeout_s`` even on a
    #: slow store (SeaweedFS here takes about 0.06 GB/s of PUTs).
    max_batch = 16

    class Settings(BackendSettings):
        endpoint_url: str | None = Field(default=None, pattern=r"^https?://")  # None: AWS itself
        bucket: str = Field(min_length=3, max_length=63, pattern=r"^[a-z0-9][a-z0-9.-]+[a-z0-9]$")
        region: str = Field(default="us-east-1", min_length=1)
        key_prefix: str = Field(default="hicache", pattern=r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*$")
        access_key_id: SecretStr | None = None  # else $AWS_ACCESS_KEY_ID
        secret_access_key: SecretStr | None = None  # else $AWS_SECRET_ACCESS_KEY
        session_token: SecretStr | None = None  # else $AWS_SESSION_TOKEN (temporary credentials)
        #: Requests in flight at once. Keep it modest: 16 concurrent multi-MiB PUTs stalled SeaweedFS.
        max_concurrency: int = Field(default=8, ge=1, le=128)
        connect_timeout_s: float = Field(default=2.0, gt=0)
        #: Bytes of pages this process keeps there, least recently used evicted first (None: leave
        #: it to the bucket's lifecycle rules).
        capacity: ByteSize | None = None

        @model_validator(mode="after")
        def _credentials_of_a_request(self, info: ValidationInfo) -> S3Backend.Settings:
            if settings_environ(info) is os.environ:
                return self
            given = [getattr(self, f) for f in ("access_key_id", "secret_access_key")]
            if not all(v is not None and v.get_secret_value() for v in given):
                raise ValueError(
                    "an s3 tier sent to the admin endpoint takes no credentials from this process's environment "
                    "(AWS_*): put access_key_id and secret_access_key in the entry"
                )
            return self

    settings: Settings

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._store: Any = None
        self._obs: Any = None  # the obstore module, imported at open
        self._prefix = self.settings.key_prefix + "/"
        self._index = LruIndex(self.settings.capacity)  # the pages this process knows are there
        self._staging = bytearray()  # the values of the set in flight (see _set)
        self._set_lock = anyio.Lock()

    def path_of(self, key: bytes) -> str:
        """The object's name in the bucket: ``{key_prefix}/{2 hex}/{key hex}`` (the 2 hex spread listings)."""
        h = key.hex()
        return f"{self._prefix}{h[:2]}/{h}"

    # -- lifecycle ------------------------------------------------------------------------------

    def _credentials(self) -> dict[str, Any]:
        """The credential: all from the settings when ``access_key_id`` is set there, else all from
        the AWS variables (never a key from one and a session token from the other)."""
        s = self.settings
        if s.access_key_id is not None and s.access_key_id.get_secret_value():
            found = {f: getattr(s, f).get_secret_value() if getattr(s, f) is not None else "" for f in _ENV}
        else:
            found = {f: os.environ.get(env, "") for f, env in _ENV.items()}
        if not (found["access_key_id"] and found["secret_access_key"]):
            raise ConfigError(
                "storage backend 's3': no credentials; set access_key_id and secret_access_key "
                "(or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY)"
            )
        return {"access_key_id": found["access_key_id"], "secret_access_key": found["secret_access_key"],
                "token": found["session_token"] or None, "expires_at": None}

    async def _open(self) -> None:
        try:
            import obstore
            from obstore.store import S3Store
        except ImportError as exc:
            raise ConfigError(f"storage backend 's3' needs obstore ({exc}); pip install hicache[s3]") from exc
        s = self.settings
        credential = self._credentials()
        config: dict[str, Any] = {"region": s.region}
        client: dict[str, Any] = {
            "timeout": timedelta(seconds=s.timeout_s),
            "connect_timeout": timedelta(seconds=s.connect_timeout_s),
        }
        if s.endpoint_url is not None:
            config["endpoint"] = s.endpoint_url
            client["allow_http"] = s.endpoint_url.startswith("http://")
        # One quick retry for a dropped connection, never past the call's own bound.
        retry = {"max_retries": 1, "retry_timeout": timedelta(seconds=s.timeout_s),
                 "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1)}}
        # No request here: a store that is down now is a miss per call, used once it answers. The
        # credential goes through a provider: it never mixes with AWS_SESSION_TOKEN & co. from the
        # environment, and stays out of the store's own config.
        try:
            self._store = S3Store(s.bucket, config=config, client_options=client, retry_config=retry,
                                  credential_provider=lambda: credential)
        except Exception as exc:  # obstore rejects the settings; its message names no secret
            raise ConfigError(f"storage backend 's3': {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        self._obs = obstore

    async def _aclose(self) -> None:
        self._store = None  # obstore closes its connection pool when the store is dropped

    # -- the three operations -------------------------------------------------------------------

    async def _exists(self, keys: Sequence[bytes]) -> int:
        async def head(key: bytes) -> object:
            try:
                await self._obs.head_async(self._store, self.path_of(key))
            except FileNotFoundError:
                return _MISSING
            return True

        results = await self._each(keys, head)
        n = self._leading(results, "exists")
        if n < len(keys) and results[n] is _MISSING:
            self._index.forget(keys[n])
        return n

    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        return await self._read(keys, into, None)

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        return await self._read(keys, into, sizes)

    async def _read(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int] | None) -> int:
        got = [0] * len(keys)

        async def fetch(i: int) -> object:
            key, io = keys[i], into[i]
            try:
                result = await self._obs.get_async(self._store, self.path_of(key))
            except FileNotFoundError:
                return _MISSING
            if not fits(result.meta["size"], io.nbytes, sizes):
                return _MISSING  # not a page of this geometry: a miss (the tier never sees it)
            blob = memoryview(await result.bytes_async())
            if len(blob) != result.meta["size"] or not fits(len(blob), io.nbytes, sizes):
                return _MISSING
            # The one copy: Rust's buffer straight into the page's own memory, after the await.
            scatter(blob, io)
            got[i] = len(blob)
            return True

        results = await self._each(range(len(keys)), fetch)
        n = self._leading(results, "get")
        for i, key in enumerate(keys[:n]):
            self._index.remember(key, got[i])
        if sizes is not None:
            sizes[:n] = got[:n]
        if n < len(keys) and results[n] is _MISSING:
            self._index.forget(keys[n])
        return n

    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        fits, victims = self._index.plan(keys, [io.nbytes for io in pages])
        async with self._set_lock:
            if victims:
                await self._delete(victims)
                self.evicted_pages += len(victims)
            values = self._stage(pages[:fits])
            ok = False
            try:

                async def put(i: int) -> object:
                    await self._obs.put_async(self._store, self.path_of(keys[i]), values[i], use_multipart=False)
                    return True

                results = await self._each(range(fits), put)
                ok = all(r is True for r in results)
            finally:
                if not ok:
                    # A request that failed or was cancelled may still read its value: leave the
                    # buffer to it, and stage the next call in fresh memory.
                    self._staging = bytearray()
        done = self._leading(results, "set")
        for key, io in zip(keys[:done], pages[:done], strict=True):
            self._index.remember(key, io.nbytes)
        return done

    async def _delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self._obs.delete_async(self._store, [self.path_of(k) for k in keys])
            for key in keys:
                self._index.forget(key)

    async def _clear(self) -> None:
        """Remove every object under ``key_prefix/`` (the bucket may hold other data)."""
        async for batch in self._obs.list(self._store, prefix=self._prefix, chunk_size=1000):
            paths = [meta["path"] for meta in batch]
            if paths:
                await self._obs.delete_async(self._store, paths)
        self._index.clear()

    # -- listing (hicache inspect) --------------------------------------------------------------

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        """Objects under ``key_prefix/`` (``LIST``, 1,000 a page), with size and last modification."""
        async for batch in self._obs.list(self._store, prefix=self._prefix, chunk_size=1000):
            out = []
            for meta in batch:
                key = self._key_of(meta["path"])
                if key is not None:
                    out.append(StoredPage(key, int(meta["size"]), meta["last_modified"].timestamp()))
            yield out

    def _key_of(self, path: str) -> bytes | None:
        shard, _, name = path[len(self._prefix) :].partition("/")
        if len(name) != 32 or name[:2] != shard:
            return None
        try:
            return bytes.fromhex(name)
        except ValueError:
            return None

    async def _read_headers(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        async def head(page: StoredPage) -> object:
            try:
                blob = await self._obs.get_range_async(self._store, self.path_of(page.key), start=0, length=HEADER_BYTES)
            except FileNotFoundError:
                return None
            return bytes(blob) if len(blob) == HEADER_BYTES else None

        async def all_heads() -> list[object]:
            return await self._each_all(pages, head)

        return await self._call("get", all_heads)  # type: ignore[return-value]

    async def _each_all(self, items: Sequence[Any], fn: Callable[[Any], Awaitable[object]]) -> list[object]:
        """``fn`` on every item, ``max_concurrency`` at a time (none stops the others)."""
        results: list[object] = [None] * len(items)
        limiter = anyio.Semaphore(self.settings.max_concurrency)

        async def one(i: int) -> None:
            async with limiter:
                try:
                    results[i] = await fn(items[i])
                except Exception:
                    results[i] = None  # a short object (range past its end) or a failed call: unread

        async with anyio.create_task_group() as tg:
            for i in range(len(items)):
                tg.start_soon(one, i)
        return results

    def _usage(self) -> tuple[int, int | None, int]:
        """What this process knows is stored (the bucket may hold more, written by others)."""
        return self._index.used, self.settings.capacity, len(self._index)

    # -- shared plumbing ------------------------------------------------------------------------

    async def _each(self, items: Sequence[Any], fn: Callable[[Any], Awaitable[object]]) -> list[object]:
        """``fn`` on each item, ``max_concurrency`` at a time, started in order.

        Results are ``True`` / ``_MISSING`` / the exception raised / ``None`` (not started: an
        earlier item was already not ``True``, so nothing past it counts).
        """
        results: list[object] = [None] * len(items)
        stop = len(items)  # the first index known not to be True
        limiter = anyio.Semaphore(self.settings.max_concurrency)

        async def one(i: int) -> None:
            nonlocal stop
            async with limiter:
                if i > stop:
                    return
                try:
                    results[i] = await fn(items[i])
                except Exception as exc:
                    results[i] = exc
                if results[i] is not True:
                    stop = min(stop, i)

        async with anyio.create_task_group() as tg:
            for i in range(len(items)):
                tg.start_soon(one, i)
        return results

    def _leading(self, results: Sequence[object], verb: str) -> int:
        """How many results from the first succeeded; the failure that ended them is raised when it
        is the first result, else counted and logged (the pages before it are still of use)."""
        n = 0
        for r in results:
            if r is not True:
                break
            n += 1
        if n < len(results) and isinstance(results[n], BaseException):
            exc = results[n]
            if n == 0:
                raise exc
            self._errors += 1
            log.debug("s3 %s: %d of %d pages, then %r", verb, n, len(results), exc)
        return n

    def _stage(self, pages: Sequence[PageIO]) -> list[memoryview]:
        """Each page as one contiguous value, in a buffer reused from call to call."""
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
