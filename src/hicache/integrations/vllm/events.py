"""hicache's KV events inside vLLM, through vLLM's own event path for connectors.

With ``--kv-events-config`` enabling events, each worker's cache keeps its journal's events
(``kv_events.sink: engine``, device tier left out: vLLM announces its own GPU blocks). Per step:

* the worker hands them over in ``KVConnectorOutput.kv_cache_events`` (``HiCacheKVEvents``);
  vLLM merges the TP workers' into one, one ``add_events`` call per worker;
* the scheduler's connector keeps, of those, what every worker announced (a rank's cache holds
  its slice of each page: a page serves only when every rank has it), carrying the rest over a few
  steps, since ranks finish the same write in different steps;
* it rewrites hicache's block hashes into the hashes vLLM computes for the same blocks
  (``hash_block_tokens`` over the parent's vLLM hash and the block's token ids, with vLLM's hash
  function and seed), so a router sees hicache's ``CPU``/``DISK``/shared blocks beside vLLM's ``GPU``
  ones under one hash; ``take_events`` hands them to vLLM's publisher with its own events.

Requests with a ``cache_salt``, LoRA adapters or multimodal inputs give vLLM block hashes with extra
keys hicache does not see: their blocks are announced under token-only hashes, which such a
request never matches (a missed hit, never a false one). A hicache page smaller than vLLM's block
is not announced (counted in ``untranslated``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core import kv_cache_utils

from ...events import base as ours

__all__ = ["HiCacheKVEvents", "SchedulerEvents", "scheduler_events", "worker_events"]

#: Steps a worker's event waits for the other ranks to announce it too.
_CARRY_STEPS = 64


def _to_vllm(e: ours.KVEvent) -> KVCacheEvent:
    if isinstance(e, ours.BlockStored):
        return BlockStored(
            block_hashes=list(e.block_hashes), parent_block_hash=e.parent_block_hash, token_ids=list(e.token_ids),
            block_size=e.block_size, lora_id=None, medium=e.medium, lora_name=None, locality=e.locality,
            ownership=e.ownership,
        )
    if isinstance(e, ours.BlockRemoved):
        return BlockRemoved(block_hashes=list(e.block_hashes), medium=e.medium, locality=e.locality,
                            ownership=e.ownership)
    return AllBlocksCleared()


class HiCacheKVEvents(KVConnectorKVEvents):
    """One step's events, a list per worker (vLLM's aggregator adds each other worker's with one
    ``add_events``), in the order they happened."""

    def __init__(self, events: list[KVCacheEvent] | None = None, *, always: bool = False) -> None:
        self.workers: list[list[KVCacheEvent]] = [list(events or [])]
        # Under TP every rank hands one over each step, empty or not: vLLM's aggregator skips a
        # falsy one, and the scheduler's side must see a list per rank to know who announced what.
        self.always = always

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self.workers.append(list(events))

    def aggregate(self) -> HiCacheKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        pass  # add_events counts them: one list each

    def get_all_events(self) -> list[KVCacheEvent]:
        return [e for w in self.workers for e in w]

    def get_number_of_workers(self) -> int:
        return len(self.workers)

    def clear_events(self) -> None:
        self.workers = [[]]

    def __bool__(self) -> bool:
        return self.always or any(self.workers)


def worker_events(journal: Any, *, ranks: int = 1) -> HiCacheKVEvents | None:
    """What the worker's cache announced since the last step (None when events are off, or when
    nothing and this is the only rank)."""
    if journal is None:
        return None
    events = journal.sink.take()
    if not events and ranks == 1:
        return None
    return HiCacheKVEvents([_to_vllm(e) for e in events], always=ranks > 1)


def _per_block(events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
    """Events of one block each: ranks group a chain's blocks into events differently (their
    copies land at different times), so they are matched block by block."""
    out: list[KVCacheEvent] = []
    for e in events:
        if isinstance(e, BlockStored) and len(e.block_hashes) > 1:
            bs = e.block_size
            parent = e.parent_block_hash
            for i, h in enumerate(e.block_hashes):
                out.append(BlockStored(
                    block_hashes=[h], parent_block_hash=parent, token_ids=list(e.token_ids[i * bs : (i + 1) * bs]),
                    block_size=bs, lora_id=None, medium=e.medium, lora_name=None, locality=e.locality,
                    ownership=e.ownership,
                ))
                parent = h
        elif isinstance(e, BlockRemoved) and len(e.block_hashes) > 1:
            out += [BlockRemoved(block_hashes=[h], medium=e.medium, locality=e.locality, ownership=e.ownership)
                    for h in e.block_hashes]
        else:
            out.append(e)
    return out


class SchedulerEvents:
    """The scheduler's side: what every worker announced, under vLLM's block hashes."""

    def __init__(self, block_size: int, page_size: int, hash_fn: Callable[[Any], bytes],
                 convert: Callable[[bytes], Any] = kv_cache_utils.maybe_convert_block_hash) -> None:
        self.block_size = block_size
        self.page_size = page_size
        self._hash_fn = hash_fn
        self._convert = convert
        self._pending: list[deque[tuple[int, KVCacheEvent]]] = []  # per worker: (step, event)
        self._step = 0
        self._ready: list[KVCacheEvent] = []
        # hicache hash -> (vLLM block hash, media announced under it): the chain's links and what
        # removals name; an entry goes when no medium holds it.
        self._hashes: dict[int, tuple[bytes, set[tuple[Any, ...]]]] = {}
        self.untranslated = 0  # blocks whose parent was never announced, or pages smaller than a block
        self.expired = 0  # events some rank never announced within _CARRY_STEPS steps

    def add(self, events: KVConnectorKVEvents) -> None:
        """A step's events from the workers (``update_connector_output``)."""
        workers = events.workers if isinstance(events, HiCacheKVEvents) else [events.get_all_events()]
        self._step += 1
        while len(self._pending) < len(workers):
            self._pending.append(deque())
        for pending, got in zip(self._pending, workers, strict=False):
            pending.extend((self._step, e) for e in (_per_block(got) if len(workers) > 1 else got))
        self._ready += self._translate(self._common())

    def take(self) -> list[KVCacheEvent]:
        out, self._ready = self._ready, []
        return out

    def _common(self) -> list[KVCacheEvent]:
        """Worker 0's events that every worker announced, in worker 0's order; older unmatched ones expire."""
        first, others = self._pending[0], self._pending[1:]
        if not others:
            out = [e for _, e in first]
            first.clear()
            return out
        counts = [Counter(e for _, e in p) for p in others]
        out, keep = [], deque()
        for step, e in first:
            if all(c[e] > 0 for c in counts):
                for c in counts:
                    c[e] -= 1
                out.append(e)
            elif self._step - step < _CARRY_STEPS:
                keep.append((step, e))
            else:
                self.expired += 1
        self._pending[0] = keep
        for p, c in zip(others, counts, strict=True):
            left = deque()
            for step, e in p:
                if c[e] > 0 and self._step - step < _CARRY_STEPS:
                    c[e] -= 1
                    left.append((step, e))
            # what worker 0 matched is consumed: keep only the surplus (by count), newest last
            p.clear()
            p.extend(left)
        return out

    def _translate(self, events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for e in events:
            if isinstance(e, BlockStored):
                stored = self._stored(e)
                if stored is not None:
                    out.append(stored)
            elif isinstance(e, BlockRemoved):
                removed = self._removed(e)
                if removed is not None:
                    out.append(removed)
            else:
                self._hashes.clear()
                out.append(e)
        return out

    def _stored(self, e: BlockStored) -> BlockStored | None:
        if self.page_size != self.block_size:
            self.untranslated += len(e.block_hashes)
            return None
        where = (e.medium, e.locality, e.ownership)
        if e.parent_block_hash is None:
            parent = None
        else:
            link = self._hashes.get(e.parent_block_hash)
            if link is None:
                self.untranslated += len(e.block_hashes)
                return None
            parent = link[0]
        first_parent = parent
        hashes: list[Any] = []
        bs = self.block_size
        for i, h in enumerate(e.block_hashes):
            tokens = e.token_ids[i * bs : (i + 1) * bs]
            entry = self._hashes.get(h)
            if entry is None:
                entry = self._hashes[h] = (kv_cache_utils.hash_block_tokens(self._hash_fn, parent, tokens), set())
            entry[1].add(where)
            parent = entry[0]
            hashes.append(self._convert(entry[0]))
        return BlockStored(
            block_hashes=hashes, parent_block_hash=None if first_parent is None else self._convert(first_parent),
            token_ids=list(e.token_ids), block_size=bs, lora_id=None, medium=e.medium, lora_name=None,
            locality=e.locality, ownership=e.ownership,
        )

    def _removed(self, e: BlockRemoved) -> BlockRemoved | None:
        where = (e.medium, e.locality, e.ownership)
        hashes: list[Any] = []
        for h in e.block_hashes:
            entry = self._hashes.get(h)
            if entry is None:
                continue
            entry[1].discard(where)
            hashes.append(self._convert(entry[0]))
            if not entry[1]:
                del self._hashes[h]
        if not hashes:
            return None
        return BlockRemoved(block_hashes=hashes, medium=e.medium, locality=e.locality, ownership=e.ownership)


def scheduler_events(vllm_config: Any, page_size: int) -> SchedulerEvents | None:
    """The scheduler's translator when vLLM publishes KV events, else None."""
    kv_events = getattr(vllm_config, "kv_events_config", None)
    if kv_events is None or not kv_events.enable_kv_cache_events:
        return None
    from vllm.utils.hashing import get_hash_fn_by_name

    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    return SchedulerEvents(vllm_config.cache_config.block_size, page_size, hash_fn)
