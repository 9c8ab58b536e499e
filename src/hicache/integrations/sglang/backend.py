"""``HiCacheStorageBackend``: SGLang's ``HiCacheStorage`` interface over hicache's storage tiers.

SGLang builds it through its backend factory (``--hicache-storage-backend dynamic``, see the package
docstring): ``HiCacheStorageBackend(storage_config, kwargs)`` checks the settings and the user's
config (a misconfiguration is a ``ConfigError`` here), then ``register_mem_pool_host(host_pool)``
learns the KV geometry and layout from SGLang's host pool, builds this rank's hicache config
(``settings.cache_config_for``), its page codec and tiers (the composition root's own builders) and
opens them on a private event loop (``loop.PrivateLoop``).

Both of SGLang's data paths:

* zero-copy (``"interface_v1": 1``): ``batch_get_v1`` / ``batch_set_v1`` read and write the host
  pool's own page memory (``host_pages.HostPages``), no staging copy;
* copy: ``batch_get`` fills the flat pages SGLang hands it, ``batch_set`` writes SGLang's flat pages,
  and ``get`` / ``set`` / ``exists`` do one page.

The two store the same bytes under the same keys: a page written by one is read by the other.
Keys: SGLang's page hashes (identical on every rank) keyed by this rank's namespace digest
(``keys.external_page_keys``), which carries the model, geometry, page order, tenant and the rank's
slice of heads and layers. Nothing here raises into SGLang's threads: a failure is a miss, counted.

SGLang's hybrid controller (sliding-window models) adds the v2 interface: ``register_mem_host_pool_v2``
for each host pool, and ``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` per pool. The
``kv`` and ``swa`` pools are served (``pools.py``: the ``swa`` pages through the same tiers, in a
namespace of their own); any other pool (Mamba state, sparse indexers, drafts) is refused when SGLang
registers it, which fails its attach with the reason.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolName, PoolTransfer, PoolTransferResult

from ...config import HiCacheConfig
from ...containers import namespace_from_config, page_codec_from_config, storage_tier_from_entry
from ...errors import UnsupportedModelError
from ...keys import Namespace, external_page_keys
from ...logs import RateLimited
from ...stats import CacheStats
from .chain import StorageChain
from .host_pages import FlatPages, HostPages, pages_of
from .loop import PrivateLoop
from .metrics import MetricsEndpoint, sglang_storage_metrics
from .pools import SlidingPool, restorable
from .settings import backend_settings, cache_config_for, check_model_name, user_config

__all__ = ["HiCacheStorageBackend"]

log = logging.getLogger("hicache.sglang")


class HiCacheStorageBackend(HiCacheStorage):
    """hicache's storage tiers as an SGLang HiCache storage backend (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        self.storage_config = storage_config
        self.settings = backend_settings(getattr(storage_config, "extra_config", None))
        # A bad file, entry, key or a model without a name fails now, before SGLang goes on.
        check_model_name(user_config(self.settings), storage_config)
        self.config: HiCacheConfig | None = None
        self.namespace: Namespace | None = None
        self.mem_pool_host: Any = None
        self._pages: HostPages | None = None
        self._chain: StorageChain | None = None
        self._loop: PrivateLoop | None = None
        self._metrics: MetricsEndpoint | None = None
        self.pools: dict[str, SlidingPool] = {}  # the v2 sidecar pools registered (``swa``)
        self._seed = b""
        self._warn = RateLimited(log)
        self.failed_calls = 0  # calls answered as misses because of an error outside the tiers

    # -- set-up ---------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the pool's geometry, build this rank's config and tiers, open them."""
        if self._chain is not None:
            raise RuntimeError("hicache's SGLang backend is bound to a host pool already")
        config = cache_config_for(self.settings, self.storage_config, mem_pool_host)
        pages = HostPages(mem_pool_host, attention=config.model.attention)
        if pages.page_bytes != config.page_bytes:
            raise RuntimeError(f"host page of {pages.page_bytes} bytes, config says {config.page_bytes}")
        namespace = namespace_from_config(config)
        codec = page_codec_from_config(config)
        tiers = [
            storage_tier_from_entry(entry, config=config, codec=codec, host=None) for entry in config.tiers.storage
        ]
        chain = StorageChain(
            tiers, page_size=config.page_size, page_bytes=config.page_bytes, writes=namespace.writes_storage,
            timeout_s=self.settings.timeout_s,
        )
        loop = PrivateLoop(name=f"hicache-sglang-tp{namespace.tp_rank}")
        try:
            loop.call(chain.open)
        except BaseException:
            loop.close()
            raise
        super().register_mem_pool_host(mem_pool_host)
        self.config, self.namespace, self._pages, self._chain, self._loop = config, namespace, pages, chain, loop
        self._seed = namespace.digest
        _open_backends.add(self)
        if self.settings.dump_config:
            self._dump_config(self.settings.dump_config)
        if self.settings.metrics_port is not None:
            # One port a rank of the machine: rank pp_rank * tp_size + tp_rank (0: any free port).
            rank = namespace.pp_rank * namespace.tp_size + namespace.tp_rank
            port = self.settings.metrics_port + rank if self.settings.metrics_port else 0
            self._metrics = MetricsEndpoint(self, self.settings.metrics_host, port)
        log.info(
            "hicache: SGLang storage over %s (%s, %s pages, TP %d/%d, PP %d/%d, %s)",
            ", ".join(f"{t.name} ({t.backend.kind})" for t in tiers), config.model.name, mem_pool_host.layout,
            namespace.tp_rank, namespace.tp_size, namespace.pp_rank, namespace.pp_size,
            "writes" if namespace.writes_storage else "reads only (another rank writes these pages)",
        )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """SGLang's hybrid controller registers each host pool of a hybrid model here, ``kv`` (the
        anchor, already bound) and ``swa``, ``mamba``, ``indexer``, .... ``kv`` and ``swa`` are
        served (``pools.py``); any other pool is refused, which fails SGLang's attach with the
        reason, and the tiers are closed: left as they were, SGLang would lose every storage hit of
        such a model and, since a backup writes the other pools first, its KV pages too."""
        name = _pool_name(host_pool_name)
        if name == "swa":
            if self._chain is None or self._pages is None or self.config is None or name in self.pools:
                why = "twice" if name in self.pools else "before the KV pool (register_mem_pool_host)"
                raise RuntimeError(f"hicache's SGLang backend: host pool {name!r} registered {why}")
            try:
                pool = SlidingPool.over(
                    name, host_pool, kv=self._pages, kv_chain=self._chain, attention=self.config.model.attention
                )
            except BaseException:
                self.close()
                raise
            self.pools[name] = pool
            log.info("hicache: SGLang host pool %r (%d layers) stored beside the KV pages", name, host_pool.layer_num)
        elif name != "kv":
            self.close()
            raise UnsupportedModelError(
                f"SGLang host pool {name!r} ({type(host_pool).__name__}): hicache's SGLang backend stores the "
                "full-attention, MLA and sliding-window (`swa`) pools only; recurrent (Mamba), indexer and draft "
                "pools of hybrid models are not supported (docs/models.md)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def _dump_config(self, path: str) -> None:
        assert self.config is not None and self.namespace is not None
        target = path.replace("{tp_rank}", str(self.namespace.tp_rank)).replace("{pp_rank}", str(self.namespace.pp_rank))
        with open(target, "w", encoding="utf-8") as f:
            f.write(self.config.to_yaml())

    # -- what the metrics collector reads (``hicache.metrics.HiCacheCollector``) -----------------

    @property
    def loop(self) -> Any:
        return None if self._loop is None else self._loop.loop

    def stats(self) -> CacheStats:
        if self._chain is None:
            raise RuntimeError("hicache's SGLang backend has no host pool yet")
        return self._chain.stats()

    # -- the bridge to the event loop -----------------------------------------------------------

    def _keys(self, keys: Sequence[str]) -> list[bytes]:
        return external_page_keys(self._seed, keys)

    def _run(self, verb: str, fn: Any, *args: Any) -> int:
        """Run a chain call on the loop; any error is a counted miss (0), never an exception."""
        return int(self._call(verb, 0, fn, *args))

    def _call(self, verb: str, miss: Any, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the loop; any error is counted and answered as ``miss``."""
        if self._chain is None or self._loop is None:
            return miss
        try:
            return self._loop.call(fn, *args)
        except Exception as exc:  # noqa: BLE001 - SGLang's threads must not die of it: a miss
            self.failed_calls += 1
            self._warn.warning(
                verb, "hicache: %s failed (%s: %s); answered as a miss (%d such calls so far)",
                verb, type(exc).__name__, exc, self.failed_calls,
            )
            return miss

    # -- zero-copy path -------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys or self._chain is None:
            return 0
        return self._run("exists", self._chain.exists, self._keys(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        pages = self._host_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        assert self._chain is not None
        got = self._run("read", self._chain.fetch, self._keys(keys), pages, self._pages)
        return [True] * got + [False] * (len(keys) - got)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        pages = self._host_pages(keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        assert self._chain is not None
        held = self._run("write", self._chain.store, self._keys(keys), pages, self._pages)
        return [True] * held + [False] * (len(keys) - held)

    def _host_pages(
        self, keys: Sequence[str], host_indices: torch.Tensor, pool: HostPages | None = None
    ) -> list[int] | None:
        pool = pool or self._pages
        if pool is None or not keys:
            return None
        pages = pages_of(host_indices, pool.page_size, len(keys))
        if pages is None or (pages and max(pages) >= pool.num_pages):
            self.failed_calls += 1
            self._warn.warning(
                "indices", "hicache: %d keys with host indices that are not %d whole pages of the pool; a miss",
                len(keys), len(keys),
            )
            return None
        return pages

    # -- v2: per-pool calls of SGLang's hybrid controller (``pools.py``) --------------------------

    def batch_exists_v2(
        self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None, extra_info: Any = None
    ) -> PoolTransferResult:
        """The prefix lengths every pool can restore: all KV pages before the end, and each
        sidecar pool's pages as its hit policy asks (``TRAILING_PAGES``: the last ``len(keys)``)."""
        if not keys or self._chain is None:
            return PoolTransferResult.empty()
        wanted = []
        for t in pool_transfers or ():
            name, policy = _pool_name(t.name), str(getattr(t.hit_policy, "value", t.hit_policy))
            pool = self.pools.get(name)
            if pool is None or policy not in ("trailing_pages", "all_pages") or t.indices_from_pool is not None:
                self.failed_calls += 1
                self._warn.warning(name, "hicache: no %s pages for pool %r; no hit", policy, name)
                return PoolTransferResult(0, {}, [])
            wanted.append((t.name, pool, max(1, len(t.keys or ())) if policy == "trailing_pages" else None))
        got = self._call("exists", None, restorable, self._chain, self._keys(keys), wanted)
        if got is None:
            return PoolTransferResult(0, {}, [])
        kv, ends = got
        usable = set(range(1, kv + 1))
        for pool_ends in ends.values():
            usable &= set(pool_ends)
        hits = {PoolName.KV: kv} if kv else {}
        hits.update({name: max(e) for name, e in ends.items() if e})
        return PoolTransferResult(max(usable, default=0), hits, sorted(usable))

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages read into its pool's host slots; a pool's list is True up to the
        first page missing or failing verification."""
        return self._pool_io("read", transfers)

    def batch_set_v2(self, transfers: list[PoolTransfer], extra_info: Any = None) -> dict[Any, list[bool]]:
        """Each transfer's pages written from its pool's host slots, True up to the first not stored."""
        return self._pool_io("write", transfers)

    def _pool_io(self, verb: str, transfers: Sequence[PoolTransfer]) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for t in transfers:
            keys = list(t.keys or ())
            name = _pool_name(t.name)
            target = (self._chain, self._pages) if name == "kv" else (
                (self.pools[name].chain, self.pools[name].pages) if name in self.pools else None
            )
            pages = None if target is None or target[0] is None else self._host_pages(keys, t.host_indices, target[1])
            if target is None and keys:
                self.failed_calls += 1
                self._warn.warning(name, "hicache: %s for unregistered pool %r; a miss", verb, name)
            if not pages:
                out[t.name] = [False] * len(keys)
                continue
            chain, source = target  # type: ignore[misc]
            n = self._run(verb, chain.fetch if verb == "read" else chain.store, self._keys(keys), pages, source)
            out[t.name] = [True] * n + [False] * (len(keys) - n)
        return out

    # -- copy path ------------------------------------------------------------------------------

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        if not keys or self._chain is None or self._pages is None:
            return [None] * len(keys)
        if target_locations is None:
            target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
        try:
            flat = FlatPages(target_locations, self._pages.page_bytes)
        except ValueError as exc:
            self.failed_calls += 1
            self._warn.warning("flat", "hicache: batch_get: %s; a miss", exc)
            return [None] * len(keys)
        got = self._run("read", self._chain.fetch, self._keys(keys), list(range(len(keys))), flat)
        return [*flat.tensors[:got], *([None] * (len(keys) - got))]

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        if not keys:
            return True
        if self._chain is None or self._pages is None or values is None or len(values) != len(keys):
            return False
        try:
            flat = FlatPages(values, self._pages.page_bytes)
        except ValueError as exc:
            self.failed_calls += 1
            self._warn.warning("flat", "hicache: batch_set: %s; not written", exc)
            return False
        return self._run("write", self._chain.store, self._keys(keys), list(range(len(keys))), flat) == len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- housekeeping ---------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's ``/hicache/storage-backend/clear``: this rank's pages by default, not every tenant's
        and model's on a shared tier (the ``clear`` setting; ``clear.py``). Each tier's outcome is logged."""
        if self._chain is None or self._loop is None:
            return
        scope = self.settings.clear
        log.warning("hicache: clearing storage on SGLang's request (clear: %s)", scope)
        try:
            done = self._loop.call(self._chain.clear, scope)
            for pool in self.pools.values():  # their pages: a namespace of their own on the same tiers
                done += self._loop.call(pool.chain.clear, scope)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot clear says so in the log
            log.warning("hicache: clear failed: %r", exc)
            return
        for t in done:
            if t.why_not is not None:
                log.warning("hicache: clear left storage tier %s as it was: %s", t.tier, t.why_not)
            elif t.removed is None:
                log.warning("hicache: clear removed every page of storage tier %s", t.tier)
            else:
                log.warning("hicache: clear removed %d pages of this rank's namespace from storage tier %s "
                            "(%d listed; the others are other namespaces')", t.removed, t.tier, t.listed)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and GB/s of each call since the last ask), when it asks."""
        if self._chain is None or self._loop is None or not self._loop.running:
            return None
        try:
            return self._loop.call(_drain, self._chain)
        except Exception:  # noqa: BLE001
            return None

    def close(self) -> None:
        """Close the tiers and stop the loop; idempotent (SGLang's detach, process exit)."""
        chain, loop, metrics = self._chain, self._loop, self._metrics
        self._chain = self._loop = self._metrics = None
        _open_backends.discard(self)
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
        if metrics is not None:
            metrics.close()
        if loop is not None:
            try:
                if chain is not None and loop.running:
                    loop.call(chain.aclose)
            except Exception as exc:  # noqa: BLE001
                log.warning("hicache: closing the storage tiers failed: %r", exc)
            finally:
                loop.close()

    def __repr__(self) -> str:
        ns = self.namespace
        where = "unbound" if ns is None else f"tp {ns.tp_rank}/{ns.tp_size} pp {ns.pp_rank}/{ns.pp_size}"
        return f"<HiCacheStorageBackend {where} {'open' if self._chain else 'closed'}>"


def _pool_name(name: Any) -> str:
    """SGLang's ``PoolName`` (a str enum) or a plain string, as its value."""
    return str(getattr(name, "value", name))


async def _drain(chain: StorageChain) -> Any:
    reads, writes = list(chain.reads), list(chain.writes_done)
    chain.reads.clear()
    chain.writes_done.clear()
    return sglang_storage_metrics(reads, writes)


# Backends SGLang never closed are closed at exit (their loops are daemon threads: nothing hangs).
_open_backends: weakref.WeakSet[HiCacheStorageBackend] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for backend in list(_open_backends):
        backend.close()
