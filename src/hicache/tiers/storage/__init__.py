"""Storage tiers below the host pool: the backend interface, the page format, built-in backends."""

from .base import BackendSettings, PageIO, StorageBackend, StorageBackendStats
from .page_format import HEADER_BYTES, PageCodec
from .registry import ENTRY_POINT_GROUP, available_backends, resolve_backend
from .tier import StorageTier

__all__ = [
    "BackendSettings", "PageIO", "StorageBackend", "StorageBackendStats", "HEADER_BYTES", "PageCodec",
    "ENTRY_POINT_GROUP", "available_backends", "resolve_backend", "StorageTier",
]
