"""Eviction and write policies."""

from .base import EvictionPolicy, WritePolicy
from .eviction import FIFOPolicy, LFUPolicy, LRUPolicy, PriorityPolicy, ScanResistantLRUPolicy
from .prefetch import BestEffort, PrefetchPolicy, Timeout, WaitComplete
from .write import WriteBack, WriteThrough, WriteThroughSelective

__all__ = [
    "EvictionPolicy",
    "WritePolicy",
    "LRUPolicy",
    "LFUPolicy",
    "FIFOPolicy",
    "PriorityPolicy",
    "ScanResistantLRUPolicy",
    "WriteThrough",
    "WriteThroughSelective",
    "WriteBack",
    "PrefetchPolicy",
    "BestEffort",
    "WaitComplete",
    "Timeout",
]
