"""What the scheduler side tells the worker side each step (pickled by vLLM across processes).

``block_ids`` holds one list per KV cache group, in vLLM's group order: one group for a model whose
layers are all of one kind (or with vLLM's hybrid KV cache manager off), one per layer kind and
position with it on (Gemma 3: one full-attention group, five sliding-window ones). A sliding
group's list has vLLM's null block (``NULL_BLOCK``) where its window has moved past: those pages
are neither loaded there nor saved from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .layout import NULL_BLOCK

__all__ = ["NULL_BLOCK", "LoadSpec", "SaveSpec", "ReceiveSpec", "HiCacheMetadata"]


@dataclass(frozen=True)
class LoadSpec:
    """Copy token pages ``first_page..end_page`` of ``tokens`` from hicache into the request's blocks.

    ``tokens`` is the prefix to retrieve (``end_page`` whole pages); pages before ``first_page``
    are already in vLLM's blocks (its own prefix cache). Copied during the step's forward, or, in
    ``HiCacheMetadata.async_loads``, before it and reported through ``get_finished``.
    """

    req_id: str
    tokens: list[int]
    first_page: int
    end_page: int
    block_ids: tuple[list[int], ...]


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
    block_ids: tuple[list[int], ...]
    #: a Mamba hybrid's states this step wrote at block boundaries in these pages (``recurrent.py``):
    #: ``(KV cache group, vLLM block, tokens)``, every Mamba group of each boundary listed
    states: tuple[tuple[int, int, int], ...] = ()

    @property
    def checkpoints(self) -> list[int]:
        """The token counts whose states the pages carry (``SlotReservation.commit``)."""
        return sorted({tokens for _, _, tokens in self.states})


@dataclass(frozen=True)
class ReceiveSpec:
    """A prefill server's KV for token pages ``first_page..end_page`` of ``tokens``, to be copied
    into the request's blocks when it arrives (an asynchronous load: the request waits in vLLM's
    ``WAITING_FOR_REMOTE_KVS`` until the worker reports it received)."""

    req_id: str
    tokens: list[int]
    first_page: int
    end_page: int
    block_ids: tuple[list[int], ...]


@dataclass
class HiCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    receives: list[ReceiveSpec] = field(default_factory=list)
    #: loads vLLM waits for (``WAITING_FOR_REMOTE_KVS``): with several KV cache groups vLLM can
    #: recompute a load that came up short only this way (its block ids repeat across groups)
    async_loads: list[LoadSpec] = field(default_factory=list)
