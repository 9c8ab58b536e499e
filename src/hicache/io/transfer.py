"""The transfer engine: every copy between the user, the device pool and the host pool.

All methods are synchronous and are called from worker threads (``anyio.to_thread``) so the event
loop keeps serving. On CUDA each direction has its own stream (``load`` for host->device, ``write``
for device->host), host memory is pinned, copies are ``non_blocking``, and load-back records one
event per layer; a method returns only when its copies have completed, so a page is never freed or
reused while a copy still touches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch

from ..tiers.base import MemoryTier
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from .base import IOBackend

__all__ = ["TransferEngine"]


class TransferEngine:
    def __init__(self, io: IOBackend, device_pool: DevicePool, host_pool: HostPool) -> None:
        self.io = io
        self.device_pool = device_pool
        self.host_pool = host_pool
        self._cuda = device_pool.device.type == "cuda"
        self._load_stream: torch.cuda.Stream | None = None
        self._write_stream: torch.cuda.Stream | None = None

    @property
    def geometry(self):  # noqa: ANN201 - KVGeometry
        return self.device_pool.geometry

    def _stream(self, which: str) -> contextlib.AbstractContextManager[object]:
        if not self._cuda:
            return contextlib.nullcontext()
        if self._load_stream is None:
            self._load_stream = torch.cuda.Stream(device=self.device_pool.device)
            self._write_stream = torch.cuda.Stream(device=self.device_pool.device)
        stream = self._load_stream if which == "load" else self._write_stream
        assert stream is not None
        # Order after whatever the engine queued on its stream (e.g. KV it just wrote).
        stream.wait_stream(torch.cuda.current_stream(self.device_pool.device))
        return torch.cuda.stream(stream)

    def _synchronize(self, which: str) -> None:
        if self._cuda:
            stream = self._load_stream if which == "load" else self._write_stream
            assert stream is not None
            stream.synchronize()

    def user_pages(self, kv: torch.Tensor, first_page: int, num_pages: int) -> torch.Tensor:
        """Page-major view ``[num_pages, C, L, E]`` of a user kv tensor ``[C, L, T, H, D]``."""
        g = self.geometry
        ps = g.page_size
        part = kv[:, :, first_page * ps : (first_page + num_pages) * ps]
        return part.reshape(g.components, g.num_layers, num_pages, g.page_elems).permute(2, 0, 1, 3)

    def user_to_pool(self, kv: torch.Tensor, first_page: int, pool: MemoryTier, pages: list[int]) -> None:
        """Write pages ``first_page..`` of a user kv tensor into ``pages`` of ``pool``."""
        if not pages:
            return
        src = self.user_pages(kv, first_page, len(pages))
        plan = self.io.plan(range(len(pages)), pages, src.device, pool.device)
        with self._stream("load"):
            self.io.copy(src, pool.page_major(), plan)
        self._synchronize("load")

    def user_layers_to_pool(
        self, kv: torch.Tensor, first_page: int, pool: MemoryTier, pages: list[int], layers: Sequence[int]
    ) -> None:
        """Write only ``layers`` of pages ``first_page..`` of a user kv tensor into ``pages`` of
        ``pool`` (the sliding layers of pages it holds thin)."""
        if not pages:
            return
        src = self.user_pages(kv, first_page, len(pages))
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        view = pool.page_major()
        with self._stream("load"):
            for layer in layers:
                view[:, :, layer].index_copy_(0, index, src[:, :, layer].to(pool.device, non_blocking=True))
        self._synchronize("load")

    def pool_layers_to_pool(
        self, src: MemoryTier, src_pages: list[int], dst: MemoryTier, dst_pages: list[int], layers: Sequence[int]
    ) -> None:
        """Copy only ``layers`` of ``src_pages`` of one pool into ``dst_pages`` of another (or the same)."""
        if not src_pages:
            return
        src_index = torch.tensor(src_pages, dtype=torch.long, device=src.device)
        dst_index = torch.tensor(dst_pages, dtype=torch.long, device=dst.device)
        src_view, dst_view = src.page_major(), dst.page_major()
        with self._stream("load"):
            for layer in layers:
                part = src_view[:, :, layer].index_select(0, src_index)
                dst_view[:, :, layer].index_copy_(0, dst_index, part.to(dst.device, non_blocking=True))
        self._synchronize("load")

    def device_to_host(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Back up (or spill) device pages to host pages, all layers at once."""
        plan = self.io.plan(device_pages, host_pages, self.device_pool.device, self.host_pool.device)
        with self._stream("write"):
            self.io.copy(self.device_pool.page_major(), self.host_pool.page_major(), plan)
        self._synchronize("write")

    def host_to_device(
        self,
        host_pages: list[int],
        device_pages: list[int],
        on_layer: Callable[[int], None],
        layerwise: bool = True,
    ) -> None:
        """Load host pages into device pages; ``on_layer(l)`` once layer ``l`` has arrived."""
        plan = self.io.plan(host_pages, device_pages, self.host_pool.device, self.device_pool.device)
        num_layers = self.geometry.num_layers
        if not layerwise:
            with self._stream("load"):
                self.io.copy(self.host_pool.page_major(), self.device_pool.page_major(), plan)
            self._synchronize("load")
            for layer in range(num_layers):
                on_layer(layer)
            return
        for layer, event in self._layer_copies(plan):
            if event is not None:
                event.synchronize()
            on_layer(layer)

    def _layer_copies(self, plan: object) -> Iterator[tuple[int, torch.cuda.Event | None]]:
        num_layers = self.geometry.num_layers
        if not self._cuda:
            for layer in range(num_layers):
                self.io.copy(self.host_pool.layer_view(layer), self.device_pool.layer_view(layer), plan, layer=layer)
                yield layer, None
            return
        # CUDA: queue every layer first, then hand each one over as its event completes.
        events: list[torch.cuda.Event] = []
        with self._stream("load"):
            for layer in range(num_layers):
                self.io.copy(self.host_pool.layer_view(layer), self.device_pool.layer_view(layer), plan, layer=layer)
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        yield from enumerate(events)

    def device_layer(self, device_pages: list[int], layer: int) -> tuple[torch.Tensor, ...]:
        """Per-component ``[tokens, H, D]`` tensors of one layer of device pages (a gather)."""
        g = self.geometry
        idx = torch.tensor(device_pages, dtype=torch.long, device=self.device_pool.device)
        kv = self.device_pool.kv
        return tuple(
            kv[c, layer].index_select(0, idx).view(len(device_pages) * g.page_size, g.num_kv_heads, g.head_dim)
            for c in range(g.components)
        )
