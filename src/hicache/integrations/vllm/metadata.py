"""What the scheduler side tells the worker side each step (pickled by vLLM across processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadSpec", "SaveSpec", "ReceiveSpec", "HiCacheMetadata"]


@dataclass(frozen=True)
class LoadSpec:
    """Copy token pages ``first_page..end_page`` of ``tokens`` from hicache into the request's blocks.

    ``tokens`` is the prefix to retrieve (``end_page`` whole pages); pages before ``first_page``
    are already in vLLM's blocks (its own prefix cache).
    """

    req_id: str
    tokens: list[int]
    first_page: int
    end_page: int
    block_ids: list[int]


@dataclass(frozen=True)
class SaveSpec:
    """Store token pages ``first_page..first_page + num_pages`` of ``tokens`` from the request's blocks.

    ``tokens`` ends at the last saved page; ``tokens[:first_page * page_size]`` is expected to be in
    hicache already (stored in an earlier step or found by the lookup).
    """

    req_id: str
    tokens: list[int]
    first_page: int
    num_pages: int
    block_ids: list[int]


@dataclass(frozen=True)
class ReceiveSpec:
    """A prefill server's KV for token pages ``first_page..end_page`` of ``tokens``, to be copied
    into the request's blocks when it arrives (an asynchronous load: the request waits in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` until the worker reports it received)."""

    req_id: str
    tokens: list[int]
    first_page: int
    end_page: int
    block_ids: list[int]


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    receives: list[ReceiveSpec] = field(default_factory=list)
