"""Builders for SGLang's real components on CPU: device and host KV pools, the backend factory, the
cache controller with its storage threads, and random page contents to compare bit for bit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MODULE = {"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HiCacheStorageBackend"}
LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("page_first", "layer_first", "page_first_direct")


@dataclass(frozen=True)
class Shape:
    """A small model: 3 layers, 2 KV heads of 32, bf16, 8-token pages (6 KiB a page)."""

    layers: int = 3
    heads: int = 2
    head_dim: int = 32
    page_size: int = 8
    tokens: int = 1200  # device pool (the host pool holds twice as many: 300 pages)
    dtype: torch.dtype = torch.bfloat16
    start_layer: int = 0
    mla: bool = False
    kv_lora_rank: int = 32
    rope_dim: int = 16


SMALL = Shape()


def pools(layout: str, shape: Shape = SMALL) -> tuple[Any, Any]:
    """``(device_pool, host_pool)``: SGLang's own, on CPU, the host pool 2x the device pool."""
    end = shape.start_layer + shape.layers - 1
    if shape.mla:
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

        device = MLATokenToKVPool(
            shape.tokens, shape.page_size, shape.dtype, shape.kv_lora_rank, shape.rope_dim, shape.layers, "cpu",
            False, start_layer=shape.start_layer, end_layer=end,
        )
        host = MLATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, shape.page_size, layout, pin_memory=False,
            device="cpu", device_capacity_tokens=device.size, start_layer=shape.start_layer, end_layer=end,
            target_layer_num=shape.layers,
        )
    else:
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

        device = MHATokenToKVPool(
            shape.tokens, shape.page_size, shape.dtype, shape.heads, shape.head_dim, shape.layers, "cpu", False,
            start_layer=shape.start_layer, end_layer=end,
        )
        host = MHATokenToKVPoolHost(
            device.get_device_pool_infos()[0].buffer_info, 2.0, 0, shape.page_size, layout, pin_memory=False,
            device="cpu", device_capacity_tokens=device.size, start_layer=shape.start_layer, end_layer=end,
        )
    return device, host


def storage_config(
    extra: dict[str, Any], *, model: str | None = "test-model", mla: bool = False, layout: str = "page_first",
    tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1,
) -> Any:
    """What SGLang's controller builds (``_generate_storage_config``), None fields and all."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=layout == "page_first",
        model_name=model, tp_lcm_size=None, should_split_heads=False, extra_config={**MODULE, **extra},
    )


def backend(host: Any, extra: dict[str, Any], **config: Any) -> Any:
    """Our backend as SGLang's factory builds it (``dynamic``), registered with ``host``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    config.setdefault("mla", type(host).__name__.startswith("MLA"))
    made = StorageBackendFactory.create_backend("dynamic", storage_config(extra, layout=host.layout, **config), host)
    made.register_mem_pool_host(host)
    return made


def page_hashes(tokens: Sequence[int], page_size: int) -> list[str]:
    """SGLang's storage keys of ``tokens``' full pages (its own hash function)."""
    from sglang.srt.mem_cache.utils import get_hash_str

    return get_hash_str(list(tokens), None, page_size=page_size)


def tokens_for(pages: int, page_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50_000, (pages * page_size,), generator=gen).tolist()


def fill(host: Any, host_indices: torch.Tensor, seed: int) -> None:
    """Random bytes (any bit pattern) in the pages at ``host_indices``."""
    gen = torch.Generator().manual_seed(seed)
    size = host.get_dummy_flat_data_page().nbytes
    for start in host_indices[:: host.page_size].tolist():
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        host.set_from_flat_data_page(start, data.view(host.dtype))


def page_bytes(host: Any, host_indices: torch.Tensor) -> torch.Tensor:
    """The pages at ``host_indices`` as bytes, in SGLang's flat page order."""
    pages = [host.get_data_page(i, flat=True).contiguous().view(torch.uint8) for i in host_indices[:: host.page_size].tolist()]
    return torch.cat(pages) if pages else torch.empty(0, dtype=torch.uint8)


@dataclass
class Rig:
    """SGLang's ``HiCacheController`` with its storage threads, over one host pool."""

    device: Any
    host: Any
    extra: dict[str, Any]
    model: str = "test-model"
    controller: Any = field(init=False)

    def __post_init__(self) -> None:
        import torch.distributed as dist
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

        allocator = PagedTokenToKVPoolAllocator(
            self.device.size, self.host.page_size, self.host.dtype, "cpu", self.device, False
        )
        self.controller = HiCacheController(
            allocator, self.host, self.host.page_size, dist.group.WORLD, threading.Event(), io_backend="direct",
            storage_backend="dynamic", model_name=self.model, storage_backend_extra_config={**MODULE, **self.extra},
        )

    @property
    def storage(self) -> Any:
        return self.controller.storage_backend

    def backup(self, host_indices: torch.Tensor, tokens: Sequence[int], timeout_s: float = 30) -> int:
        """``write_storage`` then the backup ack: tokens SGLang counts as written."""
        hashes = page_hashes(tokens, self.host.page_size)
        op_id = self.controller.write_storage(host_indices, list(tokens), hash_value=hashes)
        op = self.controller.ack_backup_queue.get(timeout=timeout_s)
        assert op.id == op_id
        return int(op.completed_tokens)

    def prefetch(self, tokens: Sequence[int], timeout_s: float = 30) -> tuple[torch.Tensor, int, int]:
        """``prefetch``, the hit query, host slots for the hit, the transfer: ``(slots, hit, loaded)``
        tokens; the slots stay allocated (the caller compares them)."""
        ctl = self.controller
        ctl.prefetch(f"req-{id(tokens)}", list(tokens), None, None)
        op = ctl.prefetch_hit_queue.get(timeout=timeout_s)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return torch.empty(0, dtype=torch.int64), 0, 0
        op.host_indices = self.host.alloc(hit)
        ctl.prefetch_buffer.put(op)
        loaded = 0
        while True:
            try:
                ack = ctl.ack_prefetch_queue.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError("no prefetch ack from SGLang's controller") from None
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.completed_req:
                return op.host_indices, hit, loaded

    def close(self) -> None:
        self.controller.detach_storage_backend()
