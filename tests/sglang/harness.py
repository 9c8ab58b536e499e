"""Builders for SGLang's real components on CPU: device and host KV pools, the backend factory, the
cache controller with its storage threads, and random page contents to compare bit for bit."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
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
        for ack in prefetch_acks(ctl, timeout_s):
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
        return op.host_indices, hit, loaded

    def close(self) -> None:
        self.controller.detach_storage_backend()


@dataclass
class HybridRig:
    """SGLang's ``HybridCacheController`` over a sliding-window model's two host pools, as SGLang's
    ``build_hybrid_swa_group`` builds them: ``kv`` (the 3 full-attention layers, the anchor) and
    ``swa`` (the 3 sliding layers), each an ``MHATokenToKVPoolHost`` over its half of an ``SWAKVPool``
    (pages of one size in both pools, so only their namespaces tell them apart). ``window`` is the
    sliding window in pages: the ``swa`` pages a prefix end needs."""

    extra: dict[str, Any]
    layout: str = "page_first"
    model: str = "test-model"
    window: int = 3
    shape: Shape = SMALL
    controller: Any = field(init=False)

    FULL_LAYERS = (1, 3, 5)
    SWA_LAYERS = (0, 2, 4)

    def __post_init__(self) -> None:
        import torch.distributed as dist
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.hicache_storage import PoolName
        from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
        from sglang.srt.mem_cache.pool_host import HostPoolGroup, PoolEntry
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        s = self.shape
        device = SWAKVPool(
            size=s.tokens, size_swa=s.tokens, page_size=s.page_size, dtype=s.dtype, head_num=s.heads,
            head_dim=s.head_dim, swa_attention_layer_ids=list(self.SWA_LAYERS),
            full_attention_layer_ids=list(self.FULL_LAYERS), device="cpu",
        )
        allocator = SWATokenToKVPoolAllocator(
            s.tokens, s.tokens, s.page_size, s.dtype, "cpu", device, need_sort=False
        )

        def host(pool: Any) -> Any:
            return MHATokenToKVPoolHost(
                pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, s.page_size, self.layout, pin_memory=False,
                device="cpu", device_capacity_tokens=pool.size, start_layer=pool.start_layer, end_layer=pool.end_layer,
            )

        self.kv, self.swa = host(device.full_kv_pool), host(device.swa_kv_pool)
        group = HostPoolGroup([
            PoolEntry(PoolName.KV, self.kv, device.full_kv_pool, lambda i: i, is_primary_index_anchor=True),
            PoolEntry(PoolName.SWA, self.swa, device.swa_kv_pool, lambda i: i),
        ])
        self.controller = HybridCacheController(
            allocator, group, s.page_size, dist.group.WORLD, threading.Event(), io_backend="direct",
            storage_backend="dynamic", model_name=self.model, storage_backend_extra_config={**MODULE, **self.extra},
            transfer_layer_id_max=len(self.FULL_LAYERS) + len(self.SWA_LAYERS),
        )

    @property
    def storage(self) -> Any:
        return self.controller.storage_backend

    def _swa_transfer(self, **kw: Any) -> Any:
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        return PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.TRAILING_PAGES, **kw)

    def backup(self, kv_slots: torch.Tensor, swa_slots: torch.Tensor, tokens: Sequence[int]) -> tuple[int, int]:
        """``write_storage`` of ``tokens`` with the ``swa`` pages of its last ``len(swa_slots)`` pages, as
        SGLang's SWA component builds it (``CacheTransferPhase.BACKUP_STORAGE``): ``(kv tokens, swa pages)``
        SGLang counts as written."""
        hashes = page_hashes(tokens, self.kv.page_size)
        n = swa_slots.numel() // self.swa.page_size
        extra = [self._swa_transfer(host_indices=swa_slots, keys=hashes[len(hashes) - n :])]
        op_id = self.controller.write_storage(kv_slots, list(tokens), hash_value=hashes, extra_pools=extra)
        op = self.controller.ack_backup_queue.get(timeout=30)
        assert op.id == op_id
        return int(op.completed_tokens), int(op.pool_storage_result.extra_pool_hit_pages.get("swa", 0))

    def prefetch(self, tokens: Sequence[int], timeout_s: float = 30) -> Prefetched:
        """SGLang's prefetch of ``tokens`` with the ``swa`` window (``CacheTransferPhase.PREFETCH``:
        placeholder keys, one a window page), the hit query, host slots for the hit in both pools
        (the ``swa`` staging as ``SWAComponent.prepare_prefetch`` sizes it), the transfers and acks."""
        from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle

        ctl, ps = self.controller, self.kv.page_size
        swa = self._swa_transfer(keys=["__placeholder__"] * self.window)
        op = ctl.prefetch(CacheRequestHandle(f"req-{id(tokens)}", 0), list(tokens), None, None, extra_pools=[swa])
        op = ctl.prefetch_hit_queue.get(timeout=timeout_s)
        hit = int(op.storage_hit_count)
        if hit == 0:
            return Prefetched(hit=0, restorable=op.pool_storage_result.restorable_prefix_pages)
        op.host_indices = self.kv.alloc(hit)
        swa.host_indices = self.swa.alloc(min(self.window, hit // ps) * ps)
        ctl.prefetch_buffer.put(op)
        loaded, swa_pages = 0, None
        for ack in prefetch_acks(ctl, timeout_s):
            if ack.completed_tokens is not None:
                loaded = max(loaded, int(ack.completed_tokens))
            if ack.pool_hits is not None:
                swa_pages = int(ack.pool_hits.get("swa", 0))
        return Prefetched(
            hit, op.pool_storage_result.restorable_prefix_pages, op.host_indices, loaded, swa.host_indices,
            swa.keys, swa_pages,
        )

    def close(self) -> None:
        self.controller.detach_storage_backend()


def prefetch_acks(ctl: Any, timeout_s: float) -> Iterator[Any]:
    """The acks of SGLang's controller for one prefetch, its last (``completed_req``) included."""
    while True:
        try:
            ack = ctl.ack_prefetch_queue.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError("no prefetch ack from SGLang's controller") from None
        yield ack
        if ack.completed_req:
            return


@dataclass
class Prefetched:
    """What one prefetch through ``HybridRig`` got: the hit (tokens), the restorable prefix lengths
    (pages) the backend answered, the KV slots and tokens loaded, the ``swa`` slots, the page hashes
    SGLang read into them and how many of those pages it counted as read (``None``: not asked)."""

    hit: int
    restorable: list[int] | None
    kv_slots: torch.Tensor | None = None
    loaded: int = 0
    swa_slots: torch.Tensor | None = None
    swa_keys: list[str] | None = None
    swa_pages: int | None = None
