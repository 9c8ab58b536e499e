"""vLLM's wire format for KV events (``vllm.distributed.kv_events``), written with msgpack alone.

A batch is an array ``[ts, events, data_parallel_rank]``; an event a map
with ``"type"`` and its fields (msgspec's tagged struct, defaults left out). vLLM's own
``msgspec.msgpack.Decoder(KVEventBatch)`` reads it (tests/vllm/test_kv_events_wire.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from .base import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["encode_batch", "decode_batch"]


def _event(e: KVEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": None, "medium": e.medium,
            "lora_name": None,
        }
    elif isinstance(e, BlockRemoved):
        out = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    elif isinstance(e, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    else:  # pragma: no cover - the journal makes only these
        raise TypeError(f"not a KV event: {e!r}")
    if e.locality is not None:
        out["locality"] = e.locality
    if e.ownership is not None:
        out["ownership"] = e.ownership
    return out


def encode_batch(ts: float, events: Sequence[KVEvent], data_parallel_rank: int | None = None) -> bytes:
    # The rank always goes out (0 when unset), as vLLM's publisher sends it: Dynamo's decoder
    # refuses a batch of two fields.
    batch = [ts, [_event(e) for e in events], data_parallel_rank or 0]
    return msgpack.packb(batch, use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """A batch back into events (for subscribers written with hicache; fields hicache does not
    write are ignored)."""
    raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    ts, items = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    events: list[KVEvent] = []
    for item in items:
        kind = item.get("type")
        if kind == "BlockStored":
            events.append(BlockStored(
                item["block_hashes"], item.get("parent_block_hash"), item.get("token_ids") or [],
                item.get("block_size", 0), item.get("medium"), item.get("locality"), item.get("ownership"),
            ))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(item["block_hashes"], item.get("medium"), item.get("locality"),
                                       item.get("ownership")))
        elif kind == "AllBlocksCleared":
            events.append(AllBlocksCleared())
    return ts, events, rank
