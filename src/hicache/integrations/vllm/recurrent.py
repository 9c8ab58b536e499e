"""vLLM's Mamba layers (``MambaSpec`` KV cache groups) as hicache's recurrent layers.

With prefix caching, vLLM keeps a Mamba layer's state in "align" mode: the block at index ``p`` of
the layer's group holds the state after exactly ``(p + 1) * block_size`` tokens, while the request
needs it, and the scheduler offers a connector each such block the step its forward writes it
(``SchedulerOutput.kv_connector_block_state.boundary_state_offloads``: ``(group, block,
tokens)``; by default only the prompt's last block boundary before its last token). Interior
blocks are nulled and reused a step or two later, so the state is copied that same step.

A hicache page ending at such a boundary carries that state as its checkpoint: the layer's raw
bytes (its tensors in ``MambaSpec.shapes`` order, as vLLM's CPU buffer holds them) laid over the
page's ``state`` cache layers, ``slot`` bytes each, zero-padded; other pages are thin there. A
hit therefore ends on a block boundary where every Mamba layer has a checkpoint, short of the
prompt's last token (vLLM computes at least one token, and a state already past it cannot be
rewound). A load fills the group's block at index ``k - 1`` of a ``k``-block hit: vLLM's loads
with several groups are waited for (``async_loads``), and vLLM copies that state into the
request's running block itself on the next step.

Mamba layers never call the connector's per-layer hooks (only attention layers do), so their
copies run at the step's end (saves) and with the waited-for loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...dtype_names import DTYPE_NAMES
from ...errors import UnsupportedModelError

__all__ = ["MambaLayer", "check_align_mode", "mamba_layers", "state_blocks", "state_from_pages", "state_to_pages"]

@dataclass(frozen=True)
class MambaLayer:
    """One Mamba layer of the model: its KV cache ``group``, the state's text (``layer_kinds``)
    and its size in bytes."""

    group: int
    state: str
    nbytes: int


def mamba_layers(kv_cache_config: Any) -> dict[int, MambaLayer]:
    """Model layer index -> its Mamba group and state, from vLLM's ``KVCacheConfig``."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import MambaSpec


    out: dict[int, MambaLayer] = {}
    if kv_cache_config is None:
        return out
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, MambaSpec):
            continue
        parts = []
        for i, (shape, dtype) in enumerate(zip(spec.shapes, spec.dtypes)):
            name = DTYPE_NAMES.get(dtype)
            if name is None:
                raise UnsupportedModelError(f"a Mamba state tensor of {dtype} is not supported")
            parts.append(f"s{i}={'x'.join(str(int(d)) for d in shape)}/{name}")
        for layer_name in group.layer_names:
            out[extract_layer_index(layer_name)] = MambaLayer(g, "+".join(parts), int(spec.state_content_size_bytes))
    return out


def check_align_mode(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ``UnsupportedModelError`` unless vLLM keeps Mamba states where hicache can take them:
    prefix caching's "align" mode, one block size for every group, no speculative blocks, and
    prefix hashes per whole block (no partial-block tails)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    cc = vllm_config.cache_config
    name = vllm_config.model_config.model
    if cc.mamba_cache_mode != "align":
        raise UnsupportedModelError(
            f"{name}: vLLM keeps Mamba states at block boundaries only with prefix caching "
            f"(mamba_cache_mode 'align'), got {cc.mamba_cache_mode!r}: enable prefix caching"
        )
    if kv_cache_config is None:
        raise UnsupportedModelError(
            f"{name}: a Mamba hybrid needs vLLM's KV cache groups (the hybrid KV cache manager)"
        )
    sizes = {group.kv_cache_spec.block_size for group in kv_cache_config.kv_cache_groups}
    if sizes != {cc.block_size}:
        raise UnsupportedModelError(f"{name}: KV cache groups of block sizes {sorted(sizes)}; hicache needs one")
    hash_block = getattr(cc, "hash_block_size", None) or cc.block_size
    if hash_block != cc.block_size:
        raise UnsupportedModelError(f"{name}: hash_block_size {hash_block} differs from block_size {cc.block_size}")
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec) and spec.num_speculative_blocks:
            raise UnsupportedModelError(f"{name}: Mamba states with speculative decoding are not supported")


def state_blocks(name: str, kv: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A Mamba layer's vLLM tensor as ``[num_blocks, nbytes]`` bytes (a view): vLLM's CPU buffer
    gives each block's raw state bytes, ``[num_blocks, 1, 1, padded]`` int8."""
    if kv.dtype not in (torch.int8, torch.uint8) or kv.dim() < 2 or not kv[0].is_contiguous() or kv[0].numel() < nbytes:
        raise UnsupportedModelError(
            f"{name}: vLLM Mamba layer of {kv.dtype} {list(kv.shape)}; expected each block's raw state bytes, "
            f"at least {nbytes}, contiguous (vLLM's CPU layout)"
        )
    return kv.view(torch.uint8).as_strided((kv.shape[0], nbytes), (kv.stride(0), 1))  # blocks are padded pages


def _slots(pages: list[torch.Tensor], page: int) -> list[torch.Tensor]:
    """A page's ``state`` cache layers as byte rows, in order: each layer's K then V part
    (``pages``: each layer's ``layer_view``, ``[pages, C, n]``; a tier's layout may interleave
    layers between a page's K and V, so each part is its own row)."""
    out = []
    for view in pages:
        for part in view[page]:
            if not part.is_contiguous():
                raise UnsupportedModelError(
                    "a tier's page layer is not contiguous: Mamba states cannot be laid over it"
                )
            out.append(part.view(torch.uint8))
    return out


def state_to_pages(state: torch.Tensor, pages: list[torch.Tensor], page: int) -> None:
    """vLLM's state bytes (``[nbytes]`` uint8) into ``page``'s ``state`` cache layers, zero-padded."""
    at, n = 0, state.numel()
    for row in _slots(pages, page):
        take = max(0, min(row.numel(), n - at))
        if take:
            row[:take].copy_(state[at : at + take])
        row[take:].zero_()
        at += take
    if at < n:
        raise UnsupportedModelError(f"a Mamba state of {n} bytes does not fit its {at} bytes of page slots")


def state_from_pages(pages: list[torch.Tensor], page: int, state: torch.Tensor) -> None:
    """``state_to_pages``'s inverse: ``page``'s checkpoint into vLLM's state bytes."""
    at, n = 0, state.numel()
    for row in _slots(pages, page):
        take = max(0, min(row.numel(), n - at))
        if take:
            state[at : at + take].copy_(row[:take])
        at += take
    if at < n:
        raise UnsupportedModelError(f"a Mamba state of {n} bytes does not fit its {at} bytes of page slots")
