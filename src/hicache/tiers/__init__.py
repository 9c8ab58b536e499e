"""Memory tiers (device, host) and, later, storage tiers."""

from .base import KVGeometry, MemoryTier, PageAllocator
from .device import DevicePool, resolve_device
from .host import HostPool

__all__ = ["KVGeometry", "MemoryTier", "PageAllocator", "DevicePool", "HostPool", "resolve_device"]
