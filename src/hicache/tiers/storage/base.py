"""The storage backend interface: three async operations over page keys, and the shared work around them.

A backend stores opaque pages (``header + payload``, see ``page_format.py``) under 16-byte page
keys. Writing one is a small class::

    class MyBackend(StorageBackend):
        kind = "mine"

        class Settings(BackendSettings):          # validated from the tier's YAML entry
            url: str

        async def _exists(self, keys) -> int: ...          # consecutive keys present from the start
        async def _get(self, keys, into) -> int: ...       # read pages into the given buffers
        async def _set(self, keys, pages) -> int: ...      # store pages; a failed one is never "present"

The public verbs (``exists``, ``get``, ``set``, ``delete``, ``clear``, ``stats``, ``aclose``) do the
shared work once for every backend: argument checks, batching (``max_batch`` pages per call of the
narrow method), the per-call timeout, mapping foreign exceptions to ``StorageBackendError`` /
``StorageTimeoutError``, and metrics. ``get`` hands the backend *destinations*: a ``PageIO`` whose
payload may be a host-pool page itself, so a backend that can read in place (``preadv``, RDMA) moves
each byte once.

All three return "how many consecutive pages from the start": pages are chained (each key names its
whole prefix), so a page after a gap is of no use. A backend is entered with ``async with`` (or
``open()`` / ``aclose()``); its constructor does no I/O.

**Listing** (optional, for ``hicache inspect``): a backend that can enumerate what it holds sets
``can_list = True`` and implements ``_list()``, an async iterator of ``StoredPage`` batches (storage
name, size, last use where known). ``list_pages()`` then yields them with the same timeout and error
mapping as every verb; a backend that cannot list raises ``ListingUnsupportedError`` saying so.
``read_stored`` reads listed pages whole, at the size the listing gave (no geometry needed), and
``read_headers`` only their headers (backends with ranged reads override ``_read_headers``).

Timeouts cancel the narrow call. A backend that runs blocking I/O in worker threads finishes the
batch in hand first (a thread cannot be interrupted, and its buffers must outlive it), so for such
backends the timeout bounds the wait between batches, not a stuck system call.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, NamedTuple
from urllib.parse import urlsplit

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from ...errors import (
    CacheClosedError,
    ConfigError,
    HiCacheError,
    InvalidRequestError,
    ListingUnsupportedError,
    StorageBackendError,
    StorageTimeoutError,
)
from ...keys import KEY_BYTES
from ...stats import LatencyHistogram, StorageBackendStats  # re-exported: the backend's snapshot type
from .page_format import HEADER_BYTES

__all__ = [
    "BackendSettings", "PageIO", "StorageBackend", "StorageBackendStats", "StoredPage", "fits", "scatter", "settings_environ",
]

_VERBS = ("exists", "get", "set", "delete", "clear", "list")


@dataclass(frozen=True)
class StoredPage:
    """One page a backend lists: its storage name, its size in bytes, and when it was last used.

    ``last_used`` is a Unix time where the backend keeps one (the file tier's mtime, which reads
    refresh; Valkey's idle time; S3's last modification), ``None`` where it cannot tell (Mooncake).
    """

    key: bytes
    size: int | None
    last_used: float | None


class PageIO(NamedTuple):
    """One page as buffers: the header, then the payload in one or more pieces, in order.

    For ``get`` all are writable. A host pool lends its own memory: one piece per page when it is
    ``page_first``, one per (component, layer) when it is ``layer_first``, so a backend with
    scatter/gather I/O (``preadv``/``writev``, multi-buffer RDMA) moves each byte exactly once.

    Two optional hooks let the tier's per-page work run where the page's bytes are, one thread
    hop per batch, never one per page:

    * ``seal`` (``set``, only to a backend with ``seals_pages``): fills ``header`` (checksum or MAC
      of the payload). The backend calls it in its own worker thread right before it writes the
      page, so one thread reads the page once for the MAC and again for the write, back to back;
    * ``landed`` (``get``, any backend may ignore it): the backend calls it, from any thread, once
      the whole page is in its buffers, so the tier checks the page on its codec threads while the
      backend is still reading the next ones. The tier checks every page it did not hear of after
      ``get`` returns: a backend that never calls it loses the overlap, nothing else.
    """

    header: memoryview
    payload: tuple[memoryview, ...]
    seal: Callable[[], None] | None = None
    landed: Callable[[], None] | None = None

    @classmethod
    def of(cls, header: Any, *payload: Any) -> PageIO:
        """Build from any buffers (bytes, bytearray, numpy arrays): flat byte views, no copy."""
        return cls(memoryview(header).cast("B"), tuple(memoryview(p).cast("B") for p in payload))

    @property
    def payload_bytes(self) -> int:
        return sum(len(p) for p in self.payload)

    @property
    def nbytes(self) -> int:
        return len(self.header) + self.payload_bytes

    def buffers(self) -> list[memoryview]:
        """Header then payload pieces: what one ``preadv``/``writev`` takes."""
        return [self.header, *self.payload]


def settings_environ(info: ValidationInfo) -> Mapping[str, str]:
    """The environment a backend's settings may read while they are validated: this process's for
    its own configuration, none for an entry that came in a request (``config.REQUEST_CONTEXT``, the
    admin endpoint), so a request can never make the server put a variable's value to use."""
    return (info.context or {}).get("environ", os.environ)


def fits(size: int, room: int, sizes: list[int] | None) -> bool:
    """Whether a stored page of ``size`` bytes is one to read into ``room`` bytes of buffers:
    exactly that size, or with ``sizes`` (pages of varying size) a header and at most ``room``."""
    return size == room if sizes is None else HEADER_BYTES <= size <= room


def scatter(blob: Any, io: PageIO) -> None:
    """Copy ``blob`` (a stored page) into ``io``'s buffers from the start, as far as it goes."""
    view = memoryview(blob).cast("B")
    pos, end = 0, len(view)
    for buf in io.buffers():
        if pos >= end:
            break
        n = min(len(buf), end - pos)
        buf[:n] = view[pos : pos + n]
        pos += n


class BackendSettings(BaseModel):
    """Settings every backend has; a backend's own ``Settings`` subclass adds its fields.

    A field named ``url`` is checked here for every backend: it must parse, with a port in range,
    and use one of ``url_schemes`` when the subclass names them (so a typo is a ``ConfigError``
    when the config loads, not an error when the cache opens).
    """

    # hide_input_in_errors: a chained ValidationError must not print a password.
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    #: The URL schemes a backend's ``url`` accepts (``None``: any).
    url_schemes: ClassVar[tuple[str, ...] | None] = None

    timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("url", check_fields=False)
    @classmethod
    def _url_parses(cls, url: object) -> object:
        if not isinstance(url, str):
            return url
        parts = urlsplit(url)
        schemes = cls.url_schemes
        if schemes is not None and parts.scheme not in schemes:
            got = f"{parts.scheme}://" if parts.scheme else "none"
            raise ValueError(f"the scheme must be one of {', '.join(s + '://' for s in schemes)}, got {got}")
        try:
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
        except ValueError:
            raise ValueError("the port must be a number from 1 to 65535") from None
        if not parts.scheme or not (parts.hostname or parts.path):
            raise ValueError("expected scheme://host[:port][/...]")
        return url


class StorageBackend(ABC):
    """Base class of every storage backend; see the module docstring."""

    kind: ClassVar[str] = "backend"
    Settings: ClassVar[type[BackendSettings]] = BackendSettings
    #: Most pages handed to one call of ``_get`` / ``_set`` / ``_exists``.
    max_batch: ClassVar[int] = 256
    #: Whether ``list_pages`` works (the backend implements ``_list``).
    can_list: ClassVar[bool] = False
    #: Whether ``get(..., sizes=)`` works (the backend implements ``_get_sized``): pages of varying
    #: size, as a tier with a codec chain stores them.
    variable_size_pages: ClassVar[bool] = False
    #: Whether ``set`` calls each page's ``PageIO.seal`` (in its worker thread, right before writing
    #: the page). The tier hands sealed pages only to such backends; to others, finished headers.
    seals_pages: ClassVar[bool] = False

    def __init__(self, **options: Any) -> None:
        try:
            self.settings = self.Settings.model_validate(options)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or '(settings)'}: {err['msg']}"
                for err in exc.errors(include_url=False)
            )
            raise ConfigError(f"storage backend {self.kind!r}: {problems}") from exc
        self._is_open = False
        self._calls = dict.fromkeys(_VERBS, 0)
        self._seconds = dict.fromkeys(_VERBS, 0.0)
        self._busy = dict.fromkeys(_VERBS, 0.0)  # wall time with a call of the verb in flight
        self._in_flight = dict.fromkeys(_VERBS, 0)
        self._busy_since = dict.fromkeys(_VERBS, 0.0)
        self._latency = {verb: LatencyHistogram() for verb in _VERBS}
        self._pages_read = self._pages_written = 0
        self._bytes_read = self._bytes_written = 0
        self._errors = self._timeouts = 0
        self.evicted_pages = 0
        self.corrupt_pages = 0
        #: Told the keys this backend no longer holds (deleted, evicted, found unusable); None for
        #: all of them (cleared). The cache's KV events listen here (``events/journal.py``).
        self.removed_hook: Callable[[Sequence[bytes] | None], None] | None = None

    @property
    def writable(self) -> bool:
        """Whether ``set`` stores pages. ``False`` for a backend that only reads (a ``nixl-peer``
        consumer without ``listen``): the cache then writes nothing to its tier and the write
        policy promises it nothing, so pages leaving memory are not counted lost for it."""
        return True

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> StorageBackend:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def open(self) -> None:
        """Connect/scan; a failure is a ``HiCacheError`` (``StorageBackendError`` wrapping any other)."""
        if not self._is_open:
            try:
                await self._open()
            except HiCacheError:
                raise
            except Exception as exc:
                raise StorageBackendError(self.kind, "open", f"{type(exc).__name__}: {_masked(exc)}") from exc
            self._is_open = True

    async def aclose(self) -> None:
        if self._is_open:
            self._is_open = False
            await self._aclose()

    # -- public verbs ---------------------------------------------------------------------------

    async def exists(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, the backend holds."""
        self._check_keys(keys)
        found = 0
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start : start + self.max_batch]
            n = await self._call("exists", self._exists, chunk)
            found += min(max(n, 0), len(chunk))
            if n < len(chunk):
                break
        return found

    async def get(self, keys: Sequence[bytes], into: Sequence[PageIO], *, sizes: list[int] | None = None) -> int:
        """Read pages ``keys`` into ``into``; return how many consecutive pages landed.

        Buffers past the returned count hold unspecified bytes. Nothing is verified here: the
        caller checks each header (``PageCodec.check``) before using a page.

        ``sizes`` (a list as long as ``keys``; backends with ``variable_size_pages``): pages have
        varying sizes (a codec chain's), each ``into[i]`` is room for at most ``into[i].nbytes``, a
        page is read whole from the start of the buffers and ``sizes[i]`` set to its length; a
        page larger than its room, or shorter than a header, ends the count. Without ``sizes``,
        a page whose size is not exactly its buffers' ends it.
        """
        self._check_keys(keys)
        self._check_pages(keys, into)
        if sizes is None:
            done = await self._transfer("get", self._get, keys, into)
            self._bytes_read += sum(io.nbytes for io in into[:done])
        else:
            if not type(self).variable_size_pages:
                raise InvalidRequestError(f"the {self.kind} backend reads pages of one size only")
            if len(sizes) != len(keys):
                raise InvalidRequestError(f"{len(keys)} keys but {len(sizes)} sizes")
            done = await self._transfer("get", self._get_sized, keys, into, sizes)
            self._bytes_read += sum(sizes[:done])
        self._pages_read += done
        return done

    async def set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        """Store ``pages`` under ``keys``; return how many consecutive pages were stored.

        A page the backend failed to store is never reported as present afterwards. Pages with a
        ``seal`` go only to a backend with ``seals_pages`` (another would store blank headers).
        """
        self._check_keys(keys)
        self._check_pages(keys, pages)
        if not type(self).seals_pages and any(io.seal is not None for io in pages):
            raise InvalidRequestError(f"the {self.kind} backend does not seal pages: hand it finished headers")
        done = await self._transfer("set", self._set, keys, pages)
        self._pages_written += done
        self._bytes_written += sum(io.nbytes for io in pages[:done])
        return done

    async def delete(self, keys: Sequence[bytes]) -> None:
        """Remove ``keys`` (missing ones are ignored): used to drop pages that failed verification."""
        self._check_keys(keys)
        try:
            for start in range(0, len(keys), self.max_batch):
                await self._call("delete", self._delete, keys[start : start + self.max_batch])
        finally:
            self._removed(keys)  # a failed delete may have removed some: no longer promised

    async def clear(self) -> None:
        """Remove every page this backend holds."""
        self._check_open()
        try:
            await self._call("clear", self._clear)
        finally:
            self._removed(None)

    def _removed(self, keys: Sequence[bytes] | None) -> None:
        """Report keys no longer held (None: all); a backend that drops pages itself calls it too."""
        if self.removed_hook is not None and (keys is None or keys):
            self.removed_hook(keys)

    def stats(self) -> StorageBackendStats:
        used, capacity, pages = self._usage()
        return StorageBackendStats(
            kind=self.kind,
            calls=MappingProxyType(dict(self._calls)),
            pages_read=self._pages_read,
            pages_written=self._pages_written,
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            errors=self._errors,
            timeouts=self._timeouts,
            seconds=MappingProxyType(dict(self._seconds)),
            used_bytes=used,
            capacity_bytes=capacity,
            stored_pages=pages,
            evicted_pages=self.evicted_pages,
            corrupt_pages=self.corrupt_pages,
            latencies=MappingProxyType({verb: h.snapshot() for verb, h in self._latency.items()}),
            busy_seconds=MappingProxyType(dict(self._busy)),
        )

    # -- listing (optional) ---------------------------------------------------------------------

    @classmethod
    def inspection_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The settings to open this backend with for ``hicache inspect`` (a reader, not a cache).

        Backends that would lend resources to the store as a side effect (Mooncake's segment)
        override this to turn that off.
        """
        return dict(options)

    async def list_pages(self) -> AsyncIterator[list[StoredPage]]:
        """Every page this backend holds (under its prefix or folder), in batches.

        Raises ``ListingUnsupportedError`` when the backend cannot list, and ``StorageError`` when a
        batch fails or exceeds ``timeout_s``. Pages written or removed meanwhile may or may not appear.
        """
        if not type(self).can_list:
            raise ListingUnsupportedError(self.kind)
        self._check_open()
        batches = self._list().__aiter__()
        while True:
            batch = await self._call("list", _next_or_none, batches)
            if batch is None:
                return
            if batch:
                yield batch

    async def read_stored(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        """Each listed page as stored (header + payload), read at its listed size; ``None`` if it is
        gone, changed size meanwhile, or is too short to hold a header (nothing to read)."""
        out: list[bytes | None] = [None] * len(pages)
        readable = [i for i, p in enumerate(pages) if p.size is not None and p.size >= HEADER_BYTES]
        pos = 0
        while pos < len(readable):
            chunk = readable[pos : pos + self.max_batch]
            bufs = [bytearray(pages[i].size or 0) for i in chunk]
            ios = [PageIO.of(memoryview(b)[:HEADER_BYTES], memoryview(b)[HEADER_BYTES:]) for b in bufs]
            n = await self.get([pages[i].key for i in chunk], ios)
            for j in range(n):
                out[chunk[j]] = bytes(bufs[j])
            pos += max(n, 0) + (1 if n < len(chunk) else 0)  # skip the page that stopped the read
        return out

    async def read_headers(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        """The first ``HEADER_BYTES`` of each listed page (``None``: gone, or shorter than a header)."""
        self._check_open()
        out: list[bytes | None] = []
        for start in range(0, len(pages), self.max_batch):
            out += await self._read_headers(pages[start : start + self.max_batch])
        return out

    async def _read_headers(self, pages: Sequence[StoredPage]) -> list[bytes | None]:
        """Default: read each page whole and keep its header. Backends with ranged reads override it
        (through ``self._call("get", ...)``, so the timeout and the error mapping apply)."""
        return [None if blob is None else blob[:HEADER_BYTES] for blob in await self.read_stored(pages)]

    async def _list(self) -> AsyncIterator[list[StoredPage]]:
        """Yield batches of ``StoredPage``; only called when ``can_list`` is set."""
        raise NotImplementedError
        yield []  # pragma: no cover - makes this an async generator

    # -- what a backend implements --------------------------------------------------------------

    @abstractmethod
    async def _exists(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys``, from the first, are stored."""

    @abstractmethod
    async def _get(self, keys: Sequence[bytes], into: Sequence[PageIO]) -> int:
        """Read each page into ``into[i].buffers()`` in order; return the consecutive count.

        A page that is missing, or whose stored size differs from the buffers, ends the count.
        """

    async def _get_sized(self, keys: Sequence[bytes], into: Sequence[PageIO], sizes: list[int]) -> int:
        """Like ``_get``, for pages of varying size: a page fits if ``HEADER_BYTES <= size <=
        into[i].nbytes``; it is read from the start of the buffers and ``sizes[i]`` set. Only
        called when ``variable_size_pages`` is set."""
        raise NotImplementedError

    @abstractmethod
    async def _set(self, keys: Sequence[bytes], pages: Sequence[PageIO]) -> int:
        """Store each page's ``buffers()``, joined, atomically; return the consecutive count."""

    async def _delete(self, keys: Sequence[bytes]) -> None:  # noqa: B027 - optional hook
        """Remove ``keys``; backends that cannot delete leave bad pages to be overwritten."""

    async def _clear(self) -> None:
        raise NotImplementedError(f"the {self.kind} backend cannot clear")

    async def _open(self) -> None:  # noqa: B027 - optional hook
        """Connect, scan, allocate: whatever must happen before the first call."""

    async def _aclose(self) -> None:  # noqa: B027 - optional hook
        """Release connections, files, threads."""

    def _usage(self) -> tuple[int | None, int | None, int | None]:
        """``(used_bytes, capacity_bytes, stored_pages)``, ``None`` where unknown."""
        return None, None, None

    # -- shared work ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._is_open:
            raise CacheClosedError(f"storage backend {self.kind!r} is not open (use `async with backend`)")

    def _check_keys(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        if isinstance(keys, (bytes, bytearray, str)):
            raise InvalidRequestError("keys must be a sequence of page keys, not a single key")
        for key in keys:
            if type(key) is not bytes or len(key) != KEY_BYTES:
                raise InvalidRequestError(f"a page key is {KEY_BYTES} bytes, got {key!r:.60}")

    @staticmethod
    def _check_pages(keys: Sequence[bytes], pages: Sequence[PageIO]) -> None:
        if len(pages) != len(keys):
            raise InvalidRequestError(f"{len(keys)} keys but {len(pages)} page buffers")
        for io in pages:
            if len(io.header) != HEADER_BYTES:
                raise InvalidRequestError(f"a page header buffer is {HEADER_BYTES} bytes, got {len(io.header)}")

    async def _transfer(
        self, verb: str, fn: Any, keys: Sequence[bytes], pages: Sequence[PageIO], sizes: list[int] | None = None
    ) -> int:
        """Call ``fn`` on ``max_batch`` pages at a time until one batch falls short."""
        done = 0
        for start in range(0, len(keys), self.max_batch):
            chunk = keys[start : start + self.max_batch]
            args: tuple[Any, ...] = (chunk, pages[start : start + len(chunk)])
            if sizes is not None:
                part = [0] * len(chunk)
                args += (part,)
            n = min(max(await self._call(verb, fn, *args), 0), len(chunk))
            if sizes is not None:
                sizes[start : start + n] = part[:n]
            done += n
            if n < len(chunk):
                break
        return done

    async def _call(self, verb: str, fn: Any, *args: Any) -> Any:
        self._calls[verb] += 1
        start = time.perf_counter()
        self._in_flight[verb] += 1
        if self._in_flight[verb] == 1:
            self._busy_since[verb] = start
        try:
            with anyio.fail_after(self.settings.timeout_s):
                return await fn(*args)
        except TimeoutError as exc:
            self._timeouts += 1
            raise StorageTimeoutError(self.kind, verb, f"no answer within {self.settings.timeout_s}s") from exc
        except HiCacheError:
            self._errors += 1
            raise
        except Exception as exc:
            self._errors += 1
            raise StorageBackendError(self.kind, verb, f"{type(exc).__name__}({_masked(exc)!r})") from exc
        finally:
            end = time.perf_counter()
            elapsed = end - start
            self._seconds[verb] += elapsed
            self._latency[verb].observe(elapsed)
            self._in_flight[verb] -= 1
            if not self._in_flight[verb]:
                self._busy[verb] += end - self._busy_since[verb]

    def __repr__(self) -> str:
        used, capacity, pages = self._usage()
        state = "open" if self._is_open else "closed"
        return f"<{type(self).__name__} {state} pages={pages} used={used} capacity={capacity}>"


async def _next_or_none(batches: AsyncIterator[list[StoredPage]]) -> list[StoredPage] | None:
    try:
        return await batches.__anext__()
    except StopAsyncIteration:
        return None


def _masked(exc: BaseException) -> str:
    """An exception's message with any URL password in it masked (client libraries quote URLs)."""
    from ...redaction import mask_url

    text = str(exc)
    if "://" not in text:
        return text
    return " ".join(mask_url(word) if "://" in word else word for word in text.split(" "))
