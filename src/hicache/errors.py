"""Every error hicache raises, in one place.

The tree::

    HiCacheError
    ├── ConfigError              a config file, environment override or dict is invalid
    ├── InvalidRequestError      a call's arguments are wrong; the cache is unchanged
    │   ├── InvalidTokensError   token ids are not a 1-D sequence of non-negative integers
    │   └── InvalidKVError       a kv tensor has the wrong shape, dtype or length
    ├── CapacityError            a tier cannot make room (everything is leased)
    ├── CacheClosedError         the cache is not open (never entered, or already closed)
    ├── WorkerFailedError        a background worker failed; the cache is unusable
    ├── StorageError             a storage backend operation failed (the cache counts it as a miss)
    │   ├── StorageBackendError  the backend raised; the original error is the ``__cause__``
    │   ├── StorageTimeoutError  the backend did not answer within its ``timeout_s``
    │   └── ListingUnsupportedError  the backend cannot list what it holds (``hicache inspect``)
    ├── UnsupportedModelError    an integration cannot cache this model's KV (or it does not match the config)
    └── EngineError              the reference engine refused or dropped a request
        ├── EngineClosedError    the engine is shutting down or closed
        ├── EngineOverloadedError  the waiting queue is full
        └── RequestCancelledError  the request was cancelled (by its caller or the shutdown)

Callers that can degrade (recompute instead of reusing KV) catch ``HiCacheError``; programming
errors (``TypeError`` from misuse of an internal API, ``AssertionError``) are not wrapped.
"""

from __future__ import annotations

__all__ = [
    "HiCacheError",
    "ConfigError",
    "InvalidRequestError",
    "InvalidTokensError",
    "InvalidKVError",
    "CapacityError",
    "CacheClosedError",
    "WorkerFailedError",
    "StorageError",
    "StorageBackendError",
    "StorageTimeoutError",
    "ListingUnsupportedError",
    "UnsupportedModelError",
    "EngineError",
    "EngineClosedError",
    "EngineOverloadedError",
    "RequestCancelledError",
]


class HiCacheError(Exception):
    """Base class of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """Raised when configuration is invalid; the message names the offending field."""


class InvalidRequestError(HiCacheError, ValueError):
    """Raised when a public call gets bad arguments. The cache state is left unchanged."""


class InvalidTokensError(InvalidRequestError):
    """Raised when token ids are not a 1-D sequence of non-negative integers."""


class InvalidKVError(InvalidRequestError):
    """Raised when a kv tensor does not match the configured geometry, dtype or token count."""


class CapacityError(HiCacheError):
    """Raised when a tier cannot free enough pages because the rest are leased or in flight."""


class CacheClosedError(HiCacheError, RuntimeError):
    """Raised when the cache is used outside ``async with HiCache(...)``."""


class WorkerFailedError(HiCacheError, RuntimeError):
    """Raised when a background worker (backup, load-back, eviction) has failed.

    The original exception is chained as ``__cause__``. Once a worker fails, every later call on
    the cache raises this error too: a cache never keeps serving with a dead worker.
    """


class StorageError(HiCacheError):
    """Raised by a storage backend's public verbs when an operation fails.

    The cache never lets it reach a caller of ``lookup``/``retrieve``/``store``: a failed read is a
    miss, a failed write is not recorded as stored, and both are counted in ``stats().storage``.
    """

    def __init__(self, backend: str, operation: str, detail: str) -> None:
        super().__init__(f"storage backend {backend!r}: {operation} failed: {detail}")
        self.backend = backend
        self.operation = operation


class StorageBackendError(StorageError):
    """The backend raised while serving ``operation``; the original exception is ``__cause__``."""


class StorageTimeoutError(StorageError):
    """The backend did not finish ``operation`` within its configured ``timeout_s``."""


class ListingUnsupportedError(StorageError):
    """The backend cannot enumerate its pages, so ``hicache inspect`` cannot walk it."""

    def __init__(self, backend: str, detail: str = "") -> None:
        why = detail or "this backend has no listing operation (a plugin adds one with can_list and _list)"
        super().__init__(backend, "list", why)


class UnsupportedModelError(HiCacheError, ValueError):
    """Raised when an integration cannot cache a model's KV, or the model does not match the config.

    The message says what differs (layers, KV heads, head dim, dtype, attention type).
    """


class EngineError(HiCacheError):
    """Base class of what the reference engine (``hicache.engine``) refuses."""


class EngineClosedError(EngineError, RuntimeError):
    """Raised when a request is submitted to an engine that is not running (or shutting down)."""


class EngineOverloadedError(EngineError):
    """Raised when the engine's waiting queue is full: back off and retry, or raise ``max_waiting``."""


class RequestCancelledError(EngineError):
    """Raised by ``RequestHandle.result()`` when the request was cancelled before it finished."""
