"""hicache: a hierarchical KV cache (device, host and storage tiers) for LLM inference engines."""

from .cache import HiCache, Hit, StoreResult
from .config import HiCacheConfig
from .containers import load_config  # the composition root: resolves storage kinds, installs from_config
from .controller.prefetch import Prefetch
from .errors import (
    CacheClosedError,
    CapacityError,
    ConfigError,
    EngineClosedError,
    EngineError,
    EngineOverloadedError,
    HiCacheError,
    InvalidKVError,
    InvalidRequestError,
    InvalidTokensError,
    RequestCancelledError,
    StorageBackendError,
    StorageError,
    StorageTimeoutError,
    UnsupportedModelError,
    WorkerFailedError,
)
from .keys import Namespace
from .leases import HeldPrefix, RetrieveView, SlotReservation
from .stats import CacheStats, StorageTierStats, TierStats
from .tiers.storage import BackendSettings, PageIO, StorageBackend, StorageBackendStats

__version__ = "0.1.0"

__all__ = [
    "HiCache",
    "Hit",
    "StoreResult",
    "HiCacheConfig",
    "load_config",
    "Namespace",
    "RetrieveView",
    "SlotReservation",
    "HeldPrefix",
    "CacheStats",
    "TierStats",
    "StorageTierStats",
    "Prefetch",
    "StorageBackend",
    "BackendSettings",
    "PageIO",
    "StorageBackendStats",
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
    "UnsupportedModelError",
    "EngineError",
    "EngineClosedError",
    "EngineOverloadedError",
    "RequestCancelledError",
]
