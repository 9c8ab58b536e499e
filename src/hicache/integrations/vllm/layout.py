"""How vLLM's paged KV maps onto hicache pages, and the per-layer copies between them.

vLLM's CPU backend keeps one tensor per attention layer, ``[num_blocks, H, block_size, 2 * D]``,
which it reads as ``[num_blocks, H, 2 * block_size, D]``: per block and head, ``block_size`` rows
of K, then ``block_size`` rows of V. hicache's device pool is ``[2, L, pages, page_size, H, D]``.

A hicache page holds ``page_size`` consecutive tokens and ``page_size`` divides the block size, so
token page ``j`` of a request lives in block ``block_ids[j // per_block]`` at sub-block
``j % per_block``. Viewing a vLLM layer as ``[num_blocks, H, 2, per_block, page_size, D]`` (a view,
no copy), a set of pages is addressed by two index tensors (block, sub-block), and each direction
is one batched gather and one batched scatter per layer, whatever the number of pages or tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UnsupportedModelError

__all__ = ["PageMap", "BlockLayout"]


@dataclass(frozen=True)
class PageMap:
    """Where ``len(pages)`` token pages of one step live: in vLLM (block, sub-block), in hicache (page)."""

    blocks: torch.Tensor  # [n] long: vLLM block ids
    subs: torch.Tensor  # [n] long: sub-block (page) index inside the block
    pages: torch.Tensor  # [n] long: hicache device pages

    @property
    def size(self) -> int:
        return int(self.pages.numel())

    @staticmethod
    def concat(maps: list[PageMap]) -> PageMap | None:
        maps = [m for m in maps if m.size]
        if not maps:
            return None
        if len(maps) == 1:
            return maps[0]
        return PageMap(
            torch.cat([m.blocks for m in maps]), torch.cat([m.subs for m in maps]), torch.cat([m.pages for m in maps])
        )


class BlockLayout:
    """The geometry shared by vLLM's blocks and hicache's pages, and the copies between them."""

    def __init__(self, *, block_size: int, page_size: int, num_kv_heads: int, head_dim: int) -> None:
        if page_size <= 0 or block_size % page_size:
            raise UnsupportedModelError(
                f"hicache page_size ({page_size}) must divide vLLM's block_size ({block_size})"
            )
        self.block_size = block_size
        self.page_size = page_size
        self.per_block = block_size // page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def check_layer(self, name: str, kv: torch.Tensor) -> None:
        """Raise ``UnsupportedModelError`` unless ``kv`` is a CPU-backend layer of this geometry."""
        want = (self.num_kv_heads, self.block_size, 2 * self.head_dim)
        if kv.dim() != 4 or tuple(kv.shape[1:]) != want or not kv.is_contiguous():
            raise UnsupportedModelError(
                f"{name}: vLLM KV layer of shape {list(kv.shape)} (contiguous: {kv.is_contiguous()}); "
                f"expected a contiguous [num_blocks, {want[0]}, {want[1]}, {want[2]}] "
                "(vLLM's CPU attention layout, K rows then V rows per block and head)"
            )

    def page_map(self, block_ids: list[int], first_page: int, pages: list[int]) -> PageMap:
        """Token pages ``first_page..first_page + len(pages)`` of a request whose blocks are ``block_ids``."""
        idx = torch.arange(first_page, first_page + len(pages), dtype=torch.long)
        table = torch.as_tensor(block_ids, dtype=torch.long)
        return PageMap(table[idx // self.per_block], idx % self.per_block, torch.as_tensor(pages, dtype=torch.long))

    def _split(self, kv: torch.Tensor) -> torch.Tensor:
        """``[num_blocks, H, 2, per_block, page_size, D]``: a view of a vLLM layer."""
        nb = kv.shape[0]
        return kv.view(nb, self.num_kv_heads, 2, self.per_block, self.page_size, self.head_dim)

    def load(self, pool_layer: torch.Tensor, kv: torch.Tensor, m: PageMap) -> None:
        """hicache -> vLLM: ``pool_layer`` is ``device_kv[:, layer]`` ``[2, pages, page_size, H, D]``."""
        src = pool_layer.index_select(1, m.pages)  # [2, n, ps, H, D]
        self._split(kv)[m.blocks, :, :, m.subs] = src.permute(1, 3, 0, 2, 4)  # [n, H, 2, ps, D]

    def save(self, kv: torch.Tensor, pool_layer: torch.Tensor, m: PageMap) -> None:
        """vLLM -> hicache, the inverse of ``load``."""
        src = self._split(kv)[m.blocks, :, :, m.subs]  # [n, H, 2, ps, D]
        pool_layer.index_copy_(1, m.pages, src.permute(2, 0, 3, 1, 4))  # [2, n, ps, H, D]
