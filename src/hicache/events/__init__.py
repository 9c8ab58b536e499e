"""KV events for cache-aware routers: what each tier of this instance can serve (docs/routing.md)."""

from .base import AllBlocksCleared, BlockRemoved, BlockStored, EventSink, KVEvent
from .journal import EventJournal, Medium, block_hash

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "EventJournal", "EventSink", "KVEvent", "Medium",
           "block_hash"]
