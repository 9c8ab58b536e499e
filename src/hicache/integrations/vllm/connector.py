"""``HiCacheConnector``: hicache as a vLLM v1 KV connector.

    KVTransferConfig(
        kv_connector="HiCacheConnector",
        kv_connector_module_path="hicache.integrations.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"config": "config/vllm.yaml", "overrides": {...}},
    )

vLLM builds one instance per role: the scheduler's (``SchedulerSide``: lookups, load and save
plans) and the worker's (``WorkerSide``: the cache itself, the per-layer copies). vLLM's paged
KV plays the device tier's part; hicache's device pool is a small staging area between vLLM's
blocks and the host tier, and hicache contributes the host tier, the storage tiers, the radix
index, the controller and its policies.

Operations: the worker's metrics reach vLLM's ``/metrics`` through its connector stats
(``metrics.py``); the worker's ``shutdown`` drains what the write policy owes storage, bounded by
the time vLLM gives its worker to exit (``vllm serve --shutdown-timeout`` must be above 0 for vLLM
to shut down gracefully at all: with its default, 0, a SIGTERM kills the worker at once).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ...errors import UnsupportedModelError
from .channel import socket_path
from .events import HiCacheKVEvents, SchedulerEvents, scheduler_events, worker_events
from .metadata import HiCacheMetadata
from .ranks import RankChannels
from .recurrent import mamba_layers
from .scheduler_side import SchedulerSide
from .settings import Roles, cache_config_for, connector_options, worker_rank
from .worker_side import WorkerSide

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["HiCacheConnector"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

# vLLM's multiprocess executor, when it shuts down, waits VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS for its
# worker to exit, then sends SIGTERM (which the worker ignores once shutting down) and 4 s later
# SIGKILL (vllm/v1/executor/multiproc_executor.py, _ensure_worker_termination).
_SIGTERM_GRACE_S = 4.0
_EXIT_MARGIN_S = 1.0  # left for the drain's log line and the rest of vLLM's teardown


def _worker_exit_budget_s(vllm_config: VllmConfig) -> float | None:
    """How long vLLM lets this worker take to exit once it shuts down (None: not bounded by vLLM)."""
    if vllm_config.parallel_config.distributed_executor_backend != "mp":
        return None
    from vllm import envs

    return max(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + _SIGTERM_GRACE_S - _EXIT_MARGIN_S, 1.0)


def _layer_groups(kv_cache_config: KVCacheConfig | None) -> dict[str, int]:
    """Each attention layer's KV cache group (vLLM's hybrid KV cache manager: one group per layer
    kind and position, each with its own block table; without it, one group)."""
    if kv_cache_config is None:
        return {}
    return {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """hicache's host and storage tiers under vLLM's paged KV (see the module docstring).

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``), which vLLM then leaves on for
    models with sliding-window layers: their blocks behind the window are freed, and hicache
    keeps their sliding layers only near prefix ends too (``docs/models.md``)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        engine_id = ktc.engine_id or str(vllm_config.instance_id)
        # Each TP rank's worker has its own cache and channel; the scheduler asks them all (ranks.py).
        self.channel_path = socket_path(engine_id, worker_rank(vllm_config))
        block_size = vllm_config.cache_config.block_size
        device = vllm_config.device_config.device_type
        options = connector_options(extra)
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.events: SchedulerEvents | None = None  # the scheduler's side of hicache's KV events
        self._ranks = vllm_config.parallel_config.tensor_parallel_size
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                log.warning(
                    "hicache: kv_load_failure_policy=%r: a load that comes up short (pages evicted or a "
                    "storage tier failing between lookup and load) fails the request; set 'recompute'",
                    ktc.kv_load_failure_policy,
                )
            config = cache_config_for(vllm_config, extra, device=device, fingerprint=False,
                                      kv_cache_config=kv_cache_config)
            ranks = RankChannels(engine_id, vllm_config.parallel_config.tensor_parallel_size)
            groups = len(kv_cache_config.kv_cache_groups) if kv_cache_config is not None else 1
            mamba = frozenset()
            if config.model.layers.recurrent:
                mamba = frozenset(m.group for m in mamba_layers(kv_cache_config).values())
            roles = Roles.of(ktc.kv_role)
            if mamba:  # prefill/decode hand-offs carry pages, not Mamba states: a cache only
                if ktc.kv_role in ("kv_producer", "kv_consumer"):
                    raise UnsupportedModelError(
                        f"{ktc.kv_role}: prefill/decode hand-offs of Mamba states are not supported"
                    )
                roles = Roles()
            self.scheduler = SchedulerSide(ranks, config.page_size, block_size, roles, groups=groups,
                                           mamba_groups=mamba)
            self.events = scheduler_events(vllm_config, config.page_size)
        else:
            config = cache_config_for(vllm_config, extra, device=device, kv_cache_config=kv_cache_config,
                                      max_shutdown_s=_worker_exit_budget_s(vllm_config))
            if config.tiers.storage and vllm_config.shutdown_timeout == 0:
                log.warning(
                    "hicache: vLLM's shutdown_timeout is 0 (its default): on SIGTERM `vllm serve` kills this worker "
                    "at once, so pages still queued for storage are neither written nor counted; start it with "
                    "--shutdown-timeout S (S above the time in-flight requests need plus controller.shutdown_timeout_s"
                    "=%.0f) and VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS at least controller.shutdown_timeout_s",
                    config.controller.shutdown_timeout_s,
                )
            self.worker = WorkerSide(config, block_size, self.channel_path, options, _layer_groups(kv_cache_config))

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is only a later miss. A producer's hand-off never reads
        # vLLM's blocks after the request's last step (its pages are copied out during the forward),
        # so a preemption cannot hand off blocks it freed: a failed hand-off is a recompute downstream.
        return False

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.start(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, HiCacheMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        return  # leased in bind_connector_metadata; copied layer by layer in wait_for_layer_load

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.before_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        if self.worker is not None:
            self.worker.after_layer(layer_name, kv_layer)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.end_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Prefill/decode: requests whose prompt is durable in the shared tier (sent: vLLM frees the
        blocks it held for them); requests whose prefill arrived, or whose load vLLM waited for
        was copied (received: vLLM schedules them); of those, the ones that came up short with
        several KV cache groups (failed: vLLM recomputes them whole)."""
        if self.worker is None:
            return KVConnectorTransferResults()
        sent, received, failed = self.worker.take_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_errors() if self.worker is not None else set()

    def get_kv_connector_kv_cache_events(self) -> HiCacheKVEvents | None:
        """What this worker's tiers announced since the last step (events.py)."""
        if self.worker is None:
            return None
        return worker_events(self.worker.events_journal(), ranks=self._ranks)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The worker's latest metrics export, once per ``stats_interval_s`` (vLLM asks every step)."""
        if self.worker is None:
            return None
        families = self.worker.take_export()
        if families is None:
            return None
        from .metrics import HiCacheConnectorStats

        return HiCacheConnectorStats(data={"families": families})

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from .metrics import HiCacheConnectorStats

        return HiCacheConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        from .metrics import HiCachePromMetrics

        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler is not None:
            self.scheduler.client.close()

    # -- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        assert self.scheduler is not None
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, num_external_tokens, blocks)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """A prefill server's hand-off counts as ``p2p`` in vLLM's metrics; hicache's own tiers as ``host``."""
        if num_external_tokens == 0:
            return {}
        assert self.scheduler is not None
        source = CacheHitSource.P2P if self.scheduler.receiving(request.request_id) else CacheHitSource.HOST
        return {source: num_external_tokens}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler is not None and connector_output.failed_recving:
            self.scheduler.loads_failed(set(connector_output.failed_recving))
        if self.events is not None and connector_output.kv_cache_events:
            self.events.add(connector_output.kv_cache_events)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """hicache's host and storage blocks under vLLM's hashes, published with vLLM's own events."""
        return self.events.take() if self.events is not None else ()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Ends the request's prefetch; a producer's prefill for a remote decode is handed off: its
        blocks are kept until its pages are durable, and the answer carries what the decode server
        needs (``kv_transfer_params``)."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid KV cache manager (its blocks per group)."""
        assert self.scheduler is not None
        return self.scheduler.request_finished(request, block_ids)
