"""The ``kernel`` io backend: few large batched copies instead of one per page.

The destination indices are cut into runs of consecutive pages (the allocators hand out the lowest
free pages, so runs are long in practice). Each run is one ``index_select(src, 0, idx, out=dst_run)``
(a gather straight into its destination, no staging), or one strided ``copy_`` when the source run
is consecutive too. On CPU this runs at the speed of a raw gather (see ``benchmarks/transfer.py``);
``index_copy_`` and allocating ``src[idx]`` are several times slower here.

Across devices (CUDA pool <-> host pool) the pages are gathered on the source device, moved in one
copy, and scattered on the destination device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import IOBackend

__all__ = ["KernelIOBackend"]


@dataclass(frozen=True)
class _Run:
    dst_start: int
    length: int
    src_start: int | None  # set when the source run is consecutive too
    src_idx: torch.Tensor | None  # otherwise the source indices of the run


@dataclass(frozen=True)
class _Plan:
    runs: tuple[_Run, ...]
    src_idx: torch.Tensor  # on the source device (cross-device path)
    dst_idx: torch.Tensor | None  # on the destination device (cross-device path only)
    cross_device: bool


class KernelIOBackend(IOBackend):
    name = "kernel"

    def plan(self, src_idx: Sequence[int], dst_idx: Sequence[int], src_device: torch.device, dst_device: torch.device) -> _Plan:
        assert len(src_idx) == len(dst_idx)
        cross = src_device != dst_device
        if cross:
            return _Plan(
                (),
                torch.tensor(list(src_idx), dtype=torch.long, device=src_device),
                torch.tensor(list(dst_idx), dtype=torch.long, device=dst_device),
                True,
            )
        src_all = torch.tensor(list(src_idx), dtype=torch.long, device=src_device)
        runs: list[_Run] = []
        n = len(dst_idx)
        i = 0
        while i < n:
            j = i + 1
            while j < n and dst_idx[j] == dst_idx[j - 1] + 1:
                j += 1
            src_consecutive = all(src_idx[k] == src_idx[k - 1] + 1 for k in range(i + 1, j))
            runs.append(
                _Run(dst_idx[i], j - i, src_idx[i], None)
                if src_consecutive
                else _Run(dst_idx[i], j - i, None, src_all[i:j])
            )
            i = j
        return _Plan(tuple(runs), src_all, None, False)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, plan: _Plan, *, layer: int | None = None) -> None:
        if plan.cross_device:
            staged = torch.index_select(src, 0, plan.src_idx)
            # Blocking for D2H: the host scatter below must see the data. H2D from a CPU tensor
            # is ordered on the current stream.
            moved = staged.to(dst.device, non_blocking=dst.device.type == "cuda")
            assert plan.dst_idx is not None
            dst.index_copy_(0, plan.dst_idx, moved)
            return
        if src.dim() == 3 and not (src[0].is_contiguous() and dst[0].is_contiguous()):
            # A layer view [pages, C, E] whose page rows are strided (K and V apart): index_select
            # takes its memcpy path only for contiguous rows, so move one component plane at a time
            # -- unless runs are so many that C times the calls would cost more than it saves.
            if (src.shape[1] - 1) * len(plan.runs) <= len(plan.src_idx) // 4:
                for src_plane, dst_plane in zip(src.unbind(1), dst.unbind(1), strict=True):
                    self._copy_runs(src_plane, dst_plane, plan)
                return
        self._copy_runs(src, dst, plan)

    @staticmethod
    def _copy_runs(src: torch.Tensor, dst: torch.Tensor, plan: _Plan) -> None:
        for run in plan.runs:
            out = dst[run.dst_start : run.dst_start + run.length]
            if run.src_start is not None:
                out.copy_(src[run.src_start : run.src_start + run.length])
            else:
                torch.index_select(src, 0, run.src_idx, out=out)
