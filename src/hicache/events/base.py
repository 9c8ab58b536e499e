"""KV events: what a router needs to know about which blocks this instance can serve, and where.

The three events and their fields are vLLM's (``vllm.distributed.kv_events``), so a router that
subscribes to vLLM workers reads hicache's with the same decoder; ``wire.py`` is the encoding.

* ``BlockStored``: blocks (pages) this instance can now serve from ``medium``, each a whole page,
  chained by ``parent_block_hash`` and carrying its ``token_ids``, so a consumer can rebuild its own
  hashes. ``medium`` names the tier: ``GPU`` (device), ``CPU`` (host), ``DISK`` (a storage tier of
  this instance) or ``SHARED`` (a storage tier several instances read: a hit on every instance that
  has it attached). Dynamo 1.6.1's indexer maps these to its device, host-pinned, disk and external
  tiers; it drops an event whose ``locality`` is ``REMOTE`` or that has an ``ownership``, so hicache
  sets neither (they are decoded from vLLM's own offloading events).
* ``BlockRemoved``: blocks ``medium`` can no longer serve.
* ``AllBlocksCleared``: forget everything this publisher announced (a start, a restart).

Block hashes are 64-bit digests of hicache's page keys under their own domain: a consumer can match
them, never turn them back into page keys or storage names (``journal.block_hash``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, Union

__all__ = ["GPU", "CPU", "DISK", "SHARED", "STORAGE", "REMOTE", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEvent", "EventSink"]

GPU = "GPU"
CPU = "CPU"
DISK = "DISK"
#: A storage tier shared by instances (Dynamo's "external" tier).
SHARED = "SHARED"
#: vLLM's offloading tiers: medium STORAGE, locality LOCAL or REMOTE (a REMOTE one is shared).
STORAGE = "STORAGE"
REMOTE = "REMOTE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    medium: str
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[int]
    medium: str
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class EventSink(Protocol):
    """Where a journal's events go. ``put`` must never block or raise: a sink that cannot keep
    up drops them, counts them and returns False (the cache never waits for a router; the journal
    then announces a clean slate and what holds now, once the sink has room)."""

    def put(self, events: Sequence[KVEvent]) -> bool: ...

    def has_room(self, events: int) -> bool: ...

    def start(self) -> None: ...

    def close(self) -> None: ...
