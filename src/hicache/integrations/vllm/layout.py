"""How vLLM's paged KV maps onto hicache pages, and the per-layer copies between them.

vLLM's CPU backend keeps one tensor per attention layer, ``[num_blocks, H, block_size, 2 * D]``,
which it reads as ``[num_blocks, H, 2 * block_size, D]``: per block and head, ``block_size`` rows
of K, then ``block_size`` rows of V. A hicache tier gives one layer of its pages as a page-major
view ``[pages, C, page_size * H * D]`` (``MemoryTier.layer_view``), whatever its real layout: the
host tier's page-first or layer-first buffer, the device pool's layer-first one.

A hicache page holds ``page_size`` consecutive tokens and ``page_size`` divides the block size, so
token page ``j`` of a request lives in block ``block_ids[j // per_block]`` at sub-block
``j % per_block``. Viewing a vLLM layer as ``[num_blocks, H, 2, per_block, page_size, D]`` (a view,
no copy), the copy between a tier's pages and vLLM's blocks is one strided ``copy_`` per *run*
(consecutive pages into consecutive blocks, or sub-blocks of one block), with the layout conversion
(``[C, page_size, H, D]`` against ``[H, C, page_size, D]``) done by that same copy. Pages are
allocated in runs on both sides, so a request's prefix is a few runs; a run of one page still
costs one copy. Measured here (SmolLM2's geometry, 60 pages, one layer): 0.6 ms per direction by
runs, against 2.2-8 ms for a gather through index tensors (which copies twice).

On the CPU the copies run in numpy, over integer views of both sides (the widest word that divides
a head's row: int64 for most geometries; numpy has no bfloat16, and a copy needs no arithmetic).
numpy copies on the calling thread: torch's ``copy_`` splits a copy of a page's layer (49,152
floats for SmolLM2, over its 32,768-element grain) across vLLM's OpenMP threads, and under
``OMP_WAIT_POLICY=PASSIVE`` each such copy wakes a sleeping thread (bound to the other core, maybe
busy with the cache's own threads): one page of one layer took 40-90 us that way against 15 us in
numpy (``benchmarks/vllm_copies.py``). The views are made once (``blocks_view``, ``pages_view``);
a copy is then numpy slicing and one ``copyto`` per run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedModelError

__all__ = ["NULL_BLOCK", "CopyRun", "BlockLayout", "copy_all"]

#: vLLM's null block: the first of its block pool, never handed out (``vllm/v1/core/block_pool.py``);
#: a sliding window's group has it where its window has moved past
NULL_BLOCK = 0


@dataclass(frozen=True)
class CopyRun:
    """``length`` pages: hicache pages ``page..`` <-> vLLM block ``block``, sub-blocks ``sub..``
    (``per_block == 1``: blocks ``block..``, consecutive)."""

    block: int
    sub: int
    page: int
    length: int


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

    def runs(self, block_ids: list[int], first_page: int, pages: list[int]) -> list[CopyRun]:
        """Token pages ``first_page..first_page + len(pages)`` of a request whose blocks are
        ``block_ids``, held in hicache ``pages``, as maximal runs. Pages in vLLM's null block (a
        sliding window's group behind its window) have nowhere to go: they are left out."""
        out: list[CopyRun] = []
        per = self.per_block
        for i, page in enumerate(pages):
            j = first_page + i
            block, sub = block_ids[j // per], j % per
            if block == NULL_BLOCK:
                continue
            if out:
                last = out[-1]
                if page == last.page + last.length:
                    if per == 1 and block == last.block + last.length:
                        out[-1] = CopyRun(last.block, 0, last.page, last.length + 1)
                        continue
                    if per > 1 and block == last.block and sub == last.sub + last.length:
                        out[-1] = CopyRun(last.block, last.sub, last.page, last.length + 1)
                        continue
            out.append(CopyRun(block, sub, page, 1))
        return out

    def first_unfit(self, block_ids: tuple[list[int], ...], sliding_groups: frozenset[int], first_page: int,
                    end_page: int, thin: tuple[tuple[int, int], ...]) -> int:
        """The first page of ``first_page..end_page`` held thin (its sliding layers' KV absent:
        ``HeldPrefix.thin``) that would land in a live block of a group with sliding layers;
        ``end_page`` if none. vLLM keeps such a block and later serves it from its own prefix
        cache, so zeros there would be read as KV (behind the window, in its null block, nothing is
        read)."""
        per = self.per_block
        for a, b in sorted(thin):
            for j in range(max(a, first_page), min(b, end_page)):
                if any(j // per < len(block_ids[g]) and block_ids[g][j // per] != NULL_BLOCK for g in sliding_groups):
                    return j
        return end_page

    def group_runs(self, block_ids: tuple[list[int], ...], first_page: int, pages: list[int],
                   skip: frozenset[int] = frozenset()) -> list[list[CopyRun]]:
        """``runs`` for each KV cache group's blocks; none for the groups in ``skip`` (a Mamba
        group's blocks hold states, not pages of KV)."""
        return [[] if g in skip else self.runs(ids, first_page, pages) for g, ids in enumerate(block_ids)]

    # -- views ----------------------------------------------------------------------------------

    def _words(self, t: torch.Tensor, shape: tuple[int, ...]) -> Any:
        """``t`` viewed as integer words, shaped ``shape`` (its last axis, ``head_dim``, in words): a
        numpy array on the CPU, a tensor elsewhere. The widest word that divides a head's row and
        ``t``'s offsets and strides; always a view (torch's ``view`` raises where it cannot be one)."""
        size = t.element_size()
        for word in _WORDS:
            per = word.itemsize // size
            if word.itemsize < size or self.head_dim % max(per, 1):
                continue
            try:
                v = t.view(word).view(*shape[:-1], shape[-1] // per)
            except RuntimeError:  # an offset or stride the wider word does not divide
                continue
            return v.numpy() if v.device.type == "cpu" else v
        raise UnsupportedModelError(f"KV of {t.dtype} cannot be viewed as integer words")

    def blocks_view(self, kv: torch.Tensor) -> Any:
        """A vLLM layer as ``[num_blocks, H, 2, per_block, page_size, D]`` (D in words)."""
        shape = (kv.shape[0], self.num_kv_heads, 2, self.per_block, self.page_size, self.head_dim)
        return self._words(kv, shape)

    def pages_view(self, tier_layer: torch.Tensor) -> Any:
        """A tier's ``layer_view`` ``[pages, C, page_size * H * D]`` as ``[pages, C, page_size, H, D]``
        (D in words)."""
        shape = (tier_layer.shape[0], tier_layer.shape[1], self.page_size, self.num_kv_heads, self.head_dim)
        return self._words(tier_layer, shape)

    def _blocks(self, blocks: Any, run: CopyRun) -> Any:
        """The run's sub-blocks in a ``blocks_view`` as ``[n, H, 2, page_size, D]`` (a view)."""
        if self.per_block == 1:
            return blocks[run.block : run.block + run.length, :, :, 0]
        return _permute(blocks[run.block, :, :, run.sub : run.sub + run.length], (2, 0, 1, 3, 4))

    # -- copies ---------------------------------------------------------------------------------

    def copy_in_runs(self, pages: Any, blocks: Any, runs: list[CopyRun]) -> list[tuple[Any, Any]]:
        """hicache -> vLLM: a ``pages_view``'s pages into a ``blocks_view``'s blocks, as ``(dst, src)``
        views, one per run, for ``copy_all``."""
        return [(self._blocks(blocks, run), _permute(pages[run.page : run.page + run.length], (0, 3, 1, 2, 4)))
                for run in runs]

    def copy_out_runs(self, blocks: Any, pages: Any, runs: list[CopyRun]) -> list[tuple[Any, Any]]:
        """vLLM -> hicache, the inverse of ``copy_in_runs``."""
        return [(pages[run.page : run.page + run.length], _permute(self._blocks(blocks, run), (0, 2, 3, 1, 4)))
                for run in runs]

    def copy_in_pairs(self, pages: Any, blocks: Any, runs: list[CopyRun]) -> list[tuple[Any, Any]]:
        """``copy_in_runs``'s copies one page each: each under torch's grain, so a cache thread's copies
        (a hand-off's receive) wake none of vLLM's OpenMP threads (``copy_all``)."""
        # Page i of a run: the next block, or the next sub-block of one.
        one_page = [CopyRun(run.block + i, 0, run.page + i, 1) if self.per_block == 1
                    else CopyRun(run.block, run.sub + i, run.page + i, 1) for run in runs for i in range(run.length)]
        return self.copy_in_runs(pages, blocks, one_page)


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _permute(a: Any, axes: tuple[int, ...]) -> Any:
    return a.transpose(axes) if isinstance(a, np.ndarray) else a.permute(*axes)


def copy_all(pairs: list[tuple[Any, Any]]) -> None:
    """Every ``(dst, src)`` copy in one call into torch (``_foreach_copy_``), which lets the GIL go
    once for all of them. From a cache thread, one ``copyto`` per page and layer gives the GIL up
    and waits for it back each time, and vLLM's thread holds it most of the time: 120 page-layers
    took 97-102 ms that way beside a thread burning Python, 7.8 ms in one call (3.2-4.2 ms both,
    quiet). A page's layer in integer words is under torch's grain (SmolLM2: 24,576 of 32,768), so
    no copy wakes vLLM's OpenMP threads."""
    if not pairs:
        return
    if any(d.dtype != s.dtype for d, s in pairs):  # words of different widths: copy_ would convert values
        for d, s in pairs:
            _copy(d, s)  # which refuses (casting="no")
        return
    if isinstance(pairs[0][0], np.ndarray):
        torch._foreach_copy_([torch.from_numpy(d) for d, _ in pairs], [torch.from_numpy(s) for _, s in pairs])
    else:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


def _copy(dst: Any, src: Any) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src, casting="no")
    else:
        dst.copy_(src)
