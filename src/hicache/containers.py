"""The composition root: the one place that knows how the parts fit together.

Every component takes plain typed arguments; only this module imports dependency-injector. Policy
kinds and io backends are chosen with ``Selector`` providers keyed by the config, so adding a kind
is one line here. Tests swap any part with ``container.<provider>.override(...)``.

The config describes, this module builds: it resolves each storage tier's ``kind`` to a backend
class and checks the backend's settings (``backend_settings``, passed to ``config.read_config`` by
``load_config``, which is ``hicache.load_config``), and reads the namespace out of the config
(``namespace_from_config``). ``build_cache`` is ``HiCache.from_config``: installed on the facade
here, so ``cache.py`` never imports this module. Singletons are per container instance, and
``build_cache`` makes a new container each time, so two caches never share a pool.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any

from dependency_injector import containers, providers

from .cache import HiCache
from .config import HiCacheConfig, KVEventsConfig, StorageTierConfig, read_config
from .config import storage_entry as described_storage_entry
from .controller.controller import CacheController
from .errors import ConfigError
from .events.buffer import EventBuffer
from .events.journal import EventJournal
from .io.direct import DirectIOBackend
from .io.kernel import KernelIOBackend
from .io.transfer import TransferEngine
from .keys import Namespace, TenantKey
from .policies.eviction import FIFOPolicy, LFUPolicy, LRUPolicy, PriorityPolicy, ScanResistantLRUPolicy
from .policies.prefetch import BestEffort, Timeout, WaitComplete
from .policies.write import WriteBack, WriteThrough, WriteThroughSelective
from .radix_tree import HiRadixTree
from .tiers.storage.layer_split import LayerSplitTier
from .tiers.base import KVGeometry
from .tiers.device import DevicePool
from .tiers.host import HostPool
from .tiers.storage.base import BackendSettings, StorageBackend
from .tiers.storage.page_format import PageCodec
from .tiers.storage.registry import resolve_backend
from .tiers.storage.tier import StorageTier

__all__ = [
    "Container", "backend_settings", "build_cache", "geometry_from_config", "inspection_target", "load_config",
    "namespace_from_config", "page_codec_from_config", "storage_entry", "storage_tier_from_entry",
    "storage_tiers_from_config", "tier_page_codec",
]


def backend_settings(kind: str, *, class_paths: bool = True) -> type[BackendSettings]:
    """The ``Settings`` of the backend ``kind`` names (``config.BackendSettingsResolver``); a
    ``ConfigError`` when it names none. ``class_paths=False``: built-ins and plugins only."""
    return resolve_backend(kind, class_paths=class_paths).Settings


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> HiCacheConfig:
    """``hicache.load_config``: ``config.read_config`` with each storage tier's backend resolved and
    its settings checked, so a bad kind or setting is a ``ConfigError`` when the config loads."""
    return read_config(path, overrides, env=env, backends=backend_settings)


def storage_entry(entry: Mapping[str, Any], where: str = "storage entry", *, from_request: bool = False) -> StorageTierConfig:
    """One ``tiers.storage`` item validated as ``load_config`` validates it (``config.storage_entry``
    with this module's resolver): what ``HiCache.attach_storage`` checks an entry with."""
    return described_storage_entry(entry, where, from_request=from_request, backends=backend_settings)


def namespace_from_config(config: HiCacheConfig) -> Namespace:
    """The namespace a config's pages live in: model identity, geometry, page size, tenant, rank slice."""
    m, p = config.model, config.parallel
    return Namespace(
        model=m.name,
        revision=m.revision,
        attention=m.attention,
        num_layers=m.num_layers,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.dtype,
        page_size=config.page_size,
        tenant_salt=config.tenant_salt,
        tenant_key=None if config.tenant_key is None else TenantKey(config.tenant_key.get_secret_value()),
        tp_rank=p.tp_rank,
        tp_size=p.tp_size,
        pp_rank=p.pp_rank,
        pp_size=p.pp_size,
        first_layer=p.pp_rank * m.num_layers if p.first_layer is None else p.first_layer,
        total_kv_heads=p.total_kv_heads,
        layer_kinds=m.layers.canonical(),
    )


def geometry_from_config(config: HiCacheConfig) -> KVGeometry:
    m = config.model
    return KVGeometry(
        components=m.kv_components,
        num_layers=config.num_cache_layers,
        page_size=config.page_size,
        num_kv_heads=m.num_kv_heads,
        head_dim=m.head_dim,
        dtype=m.torch_dtype,
    )


def tier_page_codec(codec: PageCodec, entry: StorageTierConfig) -> PageCodec:
    """The page codec of one tier: the config's, with the entry's codec chain (if any) built in.

    The chain's keys derive here: ``aes-gcm`` from the stage's own ``key`` or the tenant key's
    subkey for page encryption, each through HKDF with the namespace digest as salt.
    """
    if not entry.codec:
        return codec
    from .tiers.storage.codecs import build_chain

    secret = codec.tenant_key.derive("page-aead") if codec.tenant_key is not None else None
    try:
        chain = build_chain(entry.codec, geometry=codec.geometry, namespace=codec.namespace, tenant_secret=secret)
    except ImportError as exc:
        raise ConfigError(
            f"storage tier {entry.tier_name}: its codec needs {exc.name} (pip install 'hicache[codecs]')"
        ) from exc
    except ValueError as exc:
        raise ConfigError(f"storage tier {entry.tier_name}: codec: {exc}") from exc
    return dataclasses.replace(codec, chain=chain)


def storage_tier_from_entry(
    entry: StorageTierConfig, *, config: HiCacheConfig, codec: PageCodec, host: HostPool | None
) -> StorageTier:
    """One ``StorageTier`` for a validated ``tiers.storage`` entry; its backend is built, not opened.

    Also what ``HiCache.attach_storage`` builds a tier with at runtime (bound to the cache's own
    config, codec and host pool by the container). ``host=None``: a tier whose every call names the
    memory it reads and writes (an engine's own host pool, ``StorageTier``'s ``source``).
    """
    batch_pages = max(1, config.controller.storage_batch_bytes // config.page_bytes)
    cls = resolve_backend(entry.kind)
    # A backend that authenticates its peers (``kind: nixl-peer``) derives its secret from the tenant
    # key when it has no ``peer_token`` of its own.
    extra = {"tenant_key": codec.tenant_key} if getattr(cls, "takes_tenant_key", False) else {}
    backend = cls(**entry.options, **extra)
    parts = tier_part_codecs(config, codec, entry)
    if parts is not None:
        kinds = config.cache_layers
        return LayerSplitTier(
            entry.tier_name, backend, *parts, host, full_layers=kinds.full, sliding_layers=kinds.partial,
            window_pages=kinds.window_pages(config.page_size), batch_pages=batch_pages,
        )
    return StorageTier(entry.tier_name, backend, tier_page_codec(codec, entry), host, batch_pages=batch_pages)


def tier_part_codecs(
    config: HiCacheConfig, codec: PageCodec, entry: StorageTierConfig
) -> tuple[PageCodec, PageCodec] | None:
    """The codecs of a layer-split tier's two parts (full layers, sliding layers), or ``None`` where
    the tier keeps whole pages: a model without both kinds, ``split_layers: false``, or a backend
    of one page size only."""
    kinds = config.cache_layers
    if not (kinds.splits and entry.split_layers and resolve_backend(entry.kind).variable_size_pages):
        if config.model.layers.recurrent:
            # A whole page would carry a thin page's zeros as if they were its checkpoint.
            raise ConfigError(
                f"storage tier {entry.tier_name}: a model with recurrent layers keeps its checkpoints in a "
                f"layer-split tier only (split_layers: true, on a backend of variable page sizes; "
                f"{entry.kind!r} with split_layers: {entry.split_layers} is not one)"
            )
        return None
    if config.model.layers.recurrent and any(stage.kind == "int8" for stage in entry.codec):
        raise ConfigError(f"storage tier {entry.tier_name}: a lossy codec would change recurrent checkpoints' bytes")

    def part(layers: tuple[int, ...], name: str) -> PageCodec:
        geometry = dataclasses.replace(codec.geometry, num_layers=len(layers))
        return tier_page_codec(dataclasses.replace(codec, geometry=geometry, part=f"layers:{name}"), entry)

    # A recurrent model's second part holds its checkpoints: a part of its own name (and namespace).
    return part(kinds.full, "full"), part(kinds.partial, "state" if config.model.layers.recurrent else "sliding")


def window_pages_from_config(config: HiCacheConfig) -> int:
    """Pages before a hit's end whose sliding layers it needs, where some tier may keep them thin."""
    kinds = config.cache_layers
    return kinds.window_pages(config.page_size) if kinds.splits else 0


def shed_layers_from_config(config: HiCacheConfig) -> tuple[int, ...]:
    """The layers a compact host's pages may shed (sliding ones, where some layers stay full)."""
    kinds = config.cache_layers
    return kinds.partial if kinds.splits else ()


def window_slack_pages_from_config(config: HiCacheConfig) -> int:
    """Pages before a prefix end, past its window, whose sliding layers storage keeps too."""
    return -(-config.policies.window_slack_tokens // config.page_size)


def storage_tiers_from_config(config: HiCacheConfig, codec: PageCodec, host: HostPool) -> list[StorageTier]:
    """One ``StorageTier`` per ``tiers.storage`` entry, in order; backends are built, not opened."""
    return [storage_tier_from_entry(entry, config=config, codec=codec, host=host) for entry in config.tiers.storage]


def page_codec_from_config(config: HiCacheConfig) -> PageCodec:
    namespace = namespace_from_config(config)
    return PageCodec(namespace=namespace.digest, geometry=geometry_from_config(config), tenant_key=namespace.tenant_key)


def inspection_target(
    config: HiCacheConfig, tier: str | None = None
) -> tuple[StorageTierConfig, StorageBackend, PageCodec | tuple[PageCodec, ...]]:
    """The storage tier ``hicache inspect`` reads: its entry, a backend for it (not opened, set up as
    a reader: see ``StorageBackend.inspection_options``) and its page codec (a layer-split tier's:
    one per part)."""
    entries = config.tiers.storage
    names = [e.tier_name for e in entries]
    if not entries:
        raise ConfigError("the config has no storage tier (tiers.storage is empty): nothing to inspect")
    if tier is None:
        if len(entries) > 1:
            raise ConfigError(f"the config has {len(entries)} storage tiers ({', '.join(names)}): pick one with --tier")
        entry = entries[0]
    elif tier in names:
        entry = entries[names.index(tier)]
    else:
        raise ConfigError(f"no storage tier named {tier!r} in the config (it has: {', '.join(names)})")
    cls = resolve_backend(entry.kind)
    codec = page_codec_from_config(config)
    parts = tier_part_codecs(config, codec, entry)
    return entry, cls(**cls.inspection_options(entry.options)), parts if parts is not None else tier_page_codec(codec, entry)


#: Storage backends whose pages only this instance reads (their events say ``DISK``, not a shared tier).
_LOCAL_KINDS = frozenset({"file", "memory", "nixl"})


def kv_events_from_config(config: HiCacheConfig) -> EventJournal | None:
    """The journal and ZMQ publisher of ``kv_events``, or None when off."""
    ev = config.kv_events
    if not ev.enabled:
        return None
    if config.model.layers.hybrid:
        raise ConfigError(
            "kv_events: a hybrid model's hit may end only where sliding windows or recurrent checkpoints allow, "
            "which a router's prefix index cannot express: events are for full-attention and MLA models "
            "(docs/routing.md)"
        )
    if ev.sink == "engine":
        # The engine publishes its own blocks on the same stream: no AllBlocksCleared of ours.
        return EventJournal(EventBuffer(ev.max_queue_size), page_size=config.page_size, shared=_shared(ev),
                            device=ev.device, clean_slate=False)
    try:
        from .events.zmq_publisher import ZmqEventPublisher
    except ImportError as exc:
        raise ConfigError(f"kv_events needs pyzmq and msgpack ({exc}): pip install 'hicache[events]'") from exc
    publisher = ZmqEventPublisher(
        ev.endpoint, replay_endpoint=ev.replay_endpoint, topic=ev.topic, hwm=ev.hwm, buffer_steps=ev.buffer_steps,
        max_queue_size=ev.max_queue_size, batch_events=ev.batch_events, batch_interval_s=ev.batch_interval_s,
        data_parallel_rank=ev.data_parallel_rank,
    )
    return EventJournal(publisher, page_size=config.page_size, shared=_shared(ev), device=ev.device)


def _shared(ev: KVEventsConfig) -> Callable[[str, str], bool]:
    """Whether a storage tier (name, backend kind) is shared by instances (``kv_events.shared_tiers``)."""
    named = frozenset(ev.shared_tiers or ())

    def shared(name: str, kind: str) -> bool:
        return name in named if ev.shared_tiers is not None else kind not in _LOCAL_KINDS

    return shared


class Container(containers.DeclarativeContainer):
    config = providers.Dependency(instance_of=HiCacheConfig)

    geometry = providers.Singleton(geometry_from_config, config)
    namespace = providers.Singleton(namespace_from_config, config)
    tree = providers.Singleton(
        HiRadixTree,
        page_size=config.provided.page_size,
        namespace_digest=namespace.provided.digest,
        window_pages=providers.Callable(window_pages_from_config, config),
    )

    device_pool = providers.Singleton(
        DevicePool,
        geometry,
        capacity_bytes=config.provided.tiers.device.capacity,
        device=config.provided.tiers.device.device,
    )
    host_pool = providers.Singleton(
        HostPool,
        geometry,
        capacity_bytes=config.provided.tiers.host.capacity,
        layout=config.provided.tiers.host.layout,
        pin_memory=config.provided.tiers.host.pin_memory,
        device_tier=device_pool.provided.device,
        prefault=config.provided.tiers.host.prefault,
        sliding_layers=providers.Callable(shed_layers_from_config, config),
        compact=config.provided.tiers.host.compact,
    )

    io_backend = providers.Selector(
        config.provided.io.backend,
        kernel=providers.Singleton(KernelIOBackend),
        direct=providers.Singleton(DirectIOBackend),
    )
    transfer_engine = providers.Singleton(TransferEngine, io_backend, device_pool, host_pool)

    page_codec = providers.Singleton(
        PageCodec, namespace=namespace.provided.digest, geometry=geometry, tenant_key=namespace.provided.tenant_key
    )
    storage_tiers = providers.Singleton(storage_tiers_from_config, config, page_codec, host_pool)
    # What HiCache.attach_storage builds a tier with: an entry in, a tier bound to this cache out.
    storage_tier_builder = providers.Singleton(
        functools.partial, storage_tier_from_entry, config=config, codec=page_codec, host=host_pool
    )

    eviction_policy = providers.Selector(
        config.provided.policies.eviction,
        lru=providers.Singleton(LRUPolicy),
        lfu=providers.Singleton(LFUPolicy),
        fifo=providers.Singleton(FIFOPolicy),
        priority=providers.Singleton(PriorityPolicy),
        scan_resistant_lru=providers.Singleton(ScanResistantLRUPolicy),
    )
    write_policy = providers.Selector(
        config.provided.policies.write,
        write_through=providers.Singleton(WriteThrough),
        write_through_selective=providers.Singleton(
            WriteThroughSelective, threshold=config.provided.policies.write_threshold
        ),
        write_back=providers.Singleton(WriteBack),
    )

    prefetch_policy = providers.Selector(
        config.provided.policies.prefetch,
        best_effort=providers.Singleton(BestEffort),
        wait_complete=providers.Singleton(WaitComplete),
        timeout=providers.Singleton(
            Timeout,
            base_s=config.provided.policies.prefetch_timeout.base_s,
            per_ki_token_s=config.provided.policies.prefetch_timeout.per_ki_token_s,
            max_s=config.provided.policies.prefetch_timeout.max_s,
        ),
    )

    controller = providers.Singleton(
        CacheController,
        tree=tree,
        device=device_pool,
        host=host_pool,
        engine=transfer_engine,
        eviction_policy=eviction_policy,
        write_policy=write_policy,
        io_threads=config.provided.controller.io_threads,
        backup_queue=config.provided.controller.backup_queue,
        load_queue=config.provided.controller.load_queue,
        high_watermark=config.provided.controller.high_watermark,
        low_watermark=config.provided.controller.low_watermark,
        shutdown_timeout_s=config.provided.controller.shutdown_timeout_s,
        layerwise=config.provided.io.layerwise,
        storage=storage_tiers,
        prefetch_policy=prefetch_policy,
        prefetch_threshold_tokens=config.provided.policies.prefetch_threshold_tokens,
        storage_queue=config.provided.controller.storage_queue,
        max_prefetches=config.provided.controller.max_prefetches,
        alloc_wait_s=config.provided.controller.alloc_wait_s,
        window_slack_pages=providers.Callable(window_slack_pages_from_config, config),
        sliding_layers=providers.Callable(shed_layers_from_config, config),
        checkpoints=providers.Callable(lambda c: bool(c.model.layers.recurrent), config),
        writes_storage=namespace.provided.writes_storage,
    )

    events = providers.Singleton(kv_events_from_config, config)

    cache = providers.Singleton(
        HiCache, config, controller, namespace, build_storage_tier=storage_tier_builder,
        check_storage_entry=providers.Object(storage_entry), events=events,
    )


def build_cache(config: HiCacheConfig) -> HiCache:
    """A cache and all its parts, built from ``config`` by a new container: ``HiCache.from_config``."""
    return Container(config=config).cache()


HiCache.install_builder(build_cache)
