"""The hicache config of a vLLM engine: YAML and overrides from the connector's extra config,
the model's identity and KV geometry from vLLM's model config.

``kv_connector_extra_config`` keys:

* ``config``: a hicache YAML file (default: the packaged defaults);
* ``overrides``: a dict merged over it (same shape as the YAML);
* ``staging_tokens``: tokens of hicache's device tier (default: one vLLM block when there is a host
  tier, which the connector copies to and from directly, else ``max_model_len`` plus
  ``max_num_batched_tokens``: then the pages live there);
* ``stats_interval_s``: how often the worker reports hicache's metrics through vLLM's connector
  stats, which vLLM's ``/metrics`` then exports (default 1.0; 0 turns it off);
* ``metrics_port`` / ``metrics_host``: also serve hicache's own ``/metrics`` from the worker
  (default: not served; host ``127.0.0.1``; port 0 picks a free one, logged);
* ``gil_switch_interval_s``: the interpreter's GIL switch interval the worker sets before the
  cache starts, if shorter than the one in force (default 0.0005; ``0`` or ``null`` leaves it;
  ``gil.py`` says why);
* ``pd``: prefill/decode hand-offs (``kv_role`` ``kv_producer``, ``kv_consumer``, ``kv_both``;
  ``PDOptions``): ``tier``, the storage tier a producer's prompts must be durable in before they
  are reported sent (default: the first that takes writes), ``send_timeout_s`` (30) and
  ``receive_timeout_s`` (10), the bounds on a hand-off on each side;
* ``kv_events``: with vLLM's ``--kv-events-config`` on, whether hicache's host and storage blocks are
  published with vLLM's own events (default true; ``docs/routing.md``).

The ``model`` section is always filled from vLLM: name (the model path or id, plus the
quantization method), layers, KV heads (this rank's), head size and KV dtype. Its ``revision`` is
the weights' fingerprint (xxh3-128 over the weight files of a local model folder) unless the YAML
sets one, so KV computed by other weights under the same name is never served. ``page_size``
defaults to vLLM's block size; a page size given in the YAML must divide it. ``parallel`` is filled
too (``parallel_section``): under tensor parallelism each worker rank's cache holds its slice of the
KV heads, in a namespace of its own.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
import yaml

from ...config import HiCacheConfig
from ...containers import load_config
from ...dtype_names import DTYPE_NAMES
from ...errors import ConfigError, UnsupportedModelError
from ...layer_kinds import FULL, RECURRENT, LayerKind, LayerKinds, from_hf_config
from .gil import DEFAULT_SWITCH_INTERVAL_S
from .recurrent import check_align_mode, mamba_layers

__all__ = [
    "EXTRA_KEYS", "ConnectorOptions", "PDOptions", "Roles", "cache_config_for", "connector_options", "parallel_section", "weights_fingerprint",
    "worker_rank",
]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

EXTRA_KEYS = ("config", "overrides", "staging_tokens", "stats_interval_s", "metrics_port", "metrics_host",
              "gil_switch_interval_s", "pd", "kv_events")
_PD_KEYS = ("tier", "send_timeout_s", "receive_timeout_s")


@dataclass(frozen=True)
class PDOptions:
    """Prefill/decode hand-offs: where a producer's prompts must be durable, and how long each side waits.

    ``tier``: the name of the storage tier the KV crosses through (``None``: the first that takes
    writes; a consumer reads whichever tier has the pages). ``send_timeout_s``: a producer reports a
    prompt sent (vLLM frees its blocks) when its pages are durable there or after this long,
    counted as a failed hand-off. ``receive_timeout_s``: a consumer waits this long for the pages
    to arrive, then vLLM recomputes what did not.
    """

    tier: str | None = None
    send_timeout_s: float = 30.0
    receive_timeout_s: float = 10.0


@dataclass(frozen=True)
class Roles:
    """What a connector of ``kv_role`` does: ``kv_both`` everything; ``kv_producer`` saves prompts and
    hands them off but loads nothing of its own cache; ``kv_consumer`` receives hand-offs and loads
    what its cache holds (what arrived, mostly) but saves nothing."""

    produces: bool = False
    consumes: bool = False
    loads_cached: bool = True
    saves: bool = True

    @classmethod
    def of(cls, kv_role: str | None) -> Roles:
        if kv_role == "kv_producer":
            return cls(produces=True, loads_cached=False)
        if kv_role == "kv_consumer":
            return cls(consumes=True, saves=False)
        return cls(produces=True, consumes=True)


@dataclass(frozen=True)
class ConnectorOptions:
    """The connector's own settings from ``kv_connector_extra_config`` (the cache's are in its YAML)."""

    stats_interval_s: float = 1.0
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    gil_switch_interval_s: float | None = DEFAULT_SWITCH_INTERVAL_S
    pd: PDOptions = PDOptions()


def _pd_options(value: Any) -> PDOptions:
    if value is None:
        return PDOptions()
    if not isinstance(value, Mapping):
        raise ConfigError(f"kv_connector_extra_config.pd must be a mapping, not {value!r}")
    unknown = sorted(set(value) - set(_PD_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config.pd: unknown key(s) {unknown}; known: {list(_PD_KEYS)}")
    tier = value.get("tier")
    if tier is not None and (not isinstance(tier, str) or not tier):
        raise ConfigError(f"kv_connector_extra_config.pd.tier must be a storage tier's name, not {tier!r}")
    out: dict[str, Any] = {"tier": tier}
    for key in ("send_timeout_s", "receive_timeout_s"):
        v = value.get(key, getattr(PDOptions, key))
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"kv_connector_extra_config.pd.{key} must be a number of seconds > 0, not {v!r}")
        out[key] = float(v)
    return PDOptions(**out)


def connector_options(extra: Mapping[str, Any] | None) -> ConnectorOptions:
    """``ConnectorOptions`` from the extra config; a bad value is a ``ConfigError`` naming the key."""
    extra = dict(extra or {})
    interval = extra.get("stats_interval_s", 1.0)
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not math.isfinite(interval) or interval < 0:
        raise ConfigError(f"kv_connector_extra_config.stats_interval_s must be a number >= 0, not {interval!r}")
    port = extra.get("metrics_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535):
        raise ConfigError(f"kv_connector_extra_config.metrics_port must be a port number (0-65535), not {port!r}")
    host = extra.get("metrics_host", "127.0.0.1")
    if not isinstance(host, str) or not host:
        raise ConfigError(f"kv_connector_extra_config.metrics_host must be a host name or address, not {host!r}")
    switch = extra.get("gil_switch_interval_s", DEFAULT_SWITCH_INTERVAL_S)
    if switch is not None and (isinstance(switch, bool) or not isinstance(switch, int | float)
                               or not math.isfinite(switch) or not 0 <= switch <= 1):
        raise ConfigError(f"kv_connector_extra_config.gil_switch_interval_s must be seconds in [0, 1] or null, "
                          f"not {switch!r}")
    return ConnectorOptions(stats_interval_s=float(interval), metrics_port=port, metrics_host=host,
                            gil_switch_interval_s=float(switch) if switch else None, pd=_pd_options(extra.get("pd")))


#: the model dtypes the connector serves, by name
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 16 << 20


def weights_fingerprint(model_dir: str | os.PathLike[str]) -> str | None:
    """xxh3-128 over the names, sizes and bytes of the weight files in ``model_dir`` (None: none found)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        return None
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    if not files:
        return None
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for path in files:
        h.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def _model_section(vllm_config: Any, kv_cache_config: Any = None) -> dict[str, Any]:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    name = str(mc.model)
    if getattr(mc, "use_mla", False):
        raise UnsupportedModelError(f"{name}: latent-attention (MLA) models are not supported by the vLLM connector yet")
    if getattr(mc, "is_attention_free", False):
        raise UnsupportedModelError(
            f"{name}: attention-free models are not supported (hicache caches beside attention)"
        )
    if getattr(mc, "is_hybrid", False):
        layers = _mamba_hybrid(vllm_config, kv_cache_config)
    else:
        layers = from_hf_config(name, mc.hf_text_config)
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", None):
        raise UnsupportedModelError(f"kv_cache_dtype {cache_dtype!r}: only the model dtype ('auto') is supported")
    dtype = DTYPE_NAMES.get(mc.dtype)
    if dtype is None:
        raise UnsupportedModelError(f"{name}: dtype {mc.dtype} is not supported")
    if mc.quantization:
        name = f"{name}|quantization={mc.quantization}"
    if layers.hybrid and getattr(mc, "disable_sliding_window", False):
        name = f"{name}|sliding-window-disabled"  # its sliding layers attend over everything: other KV
    return {
        "name": name,
        "num_layers": mc.get_num_layers(pc),
        "num_kv_heads": mc.get_num_kv_heads(pc),
        "head_dim": mc.get_head_size(),
        "dtype": dtype,
        "attention": "mha",
        "layers": [k.text for k in layers],
    }


def _mamba_hybrid(vllm_config: Any, kv_cache_config: Any) -> LayerKinds:
    """A Mamba hybrid's layers: recurrent ones with vLLM's state tensors (``recurrent.py``), the
    others full attention."""
    name = str(vllm_config.model_config.model)
    if kv_cache_config is None:
        raise UnsupportedModelError(f"{name}: a hybrid model's Mamba states are known only from vLLM's KV cache groups")
    check_align_mode(vllm_config, kv_cache_config)
    mamba = mamba_layers(kv_cache_config)
    if not mamba:
        raise UnsupportedModelError(f"{name}: a hybrid model without Mamba groups is not supported")
    if getattr(vllm_config.model_config.hf_text_config, "sliding_window", None):
        raise UnsupportedModelError(f"{name}: sliding-window and recurrent layers in one model are not supported")
    n = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
    kinds = [LayerKind(RECURRENT, state=mamba[i].state) if i in mamba else LayerKind(FULL) for i in range(n)]
    return LayerKinds.parse(kinds)


def worker_rank(vllm_config: Any) -> int:
    """This worker's index among the engine's workers (its TP rank: pipeline parallelism is refused).

    vLLM numbers workers DP x PP x TP and sets ``parallel_config.rank`` in each worker before it
    builds the connector; the scheduler's process keeps the default 0.
    """
    pc = vllm_config.parallel_config
    return int(getattr(pc, "rank", 0) or 0) % pc.tensor_parallel_size


def parallel_section(vllm_config: Any) -> dict[str, Any]:
    """hicache's ``parallel`` section for this worker: TP rank, TP size and the model's KV heads.

    vLLM splits the KV heads in rank order and, with fewer heads than ranks, replicates each on
    ``tp_size / heads`` consecutive ranks: the layout ``Namespace`` assumes. Pipeline and context
    parallelism are refused (a stage's layer names would need offsetting, which vLLM's CPU build
    cannot run here to test; context parallelism splits a request's tokens over ranks).
    """
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise UnsupportedModelError(
            f"pipeline_parallel_size {pc.pipeline_parallel_size}: the hicache vLLM connector supports "
            "tensor parallelism only (pipeline_parallel_size 1)"
        )
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if int(getattr(pc, name, 1) or 1) != 1:
            raise UnsupportedModelError(f"{name} {getattr(pc, name)}: a rank would hold only some of a request's tokens")
    return {
        "tp_rank": worker_rank(vllm_config),
        "tp_size": pc.tensor_parallel_size,
        "total_kv_heads": vllm_config.model_config.get_total_num_kv_heads(),
    }


def _explicit_page_size(path: str | None, overrides: Mapping[str, Any]) -> bool:
    if "page_size" in overrides or "HICACHE_PAGE_SIZE" in os.environ:
        return True
    if path is None:
        return False
    try:
        data = yaml.safe_load(Path(path).expanduser().read_text()) or {}
    except (OSError, yaml.YAMLError):
        return False  # load_config reports it properly
    return isinstance(data, dict) and "page_size" in data


def cache_config_for(
    vllm_config: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    device: str = "cpu",
    fingerprint: bool = True,
    max_shutdown_s: float | None = None,
    kv_cache_config: Any = None,
) -> HiCacheConfig:
    """The ``HiCacheConfig`` for a vLLM engine (``extra``: ``kv_connector_extra_config``).

    ``fingerprint=False`` skips hashing the weights (the scheduler side needs only the geometry).
    ``max_shutdown_s``: how long vLLM lets the worker take to exit; ``controller.shutdown_timeout_s``
    is cut to it (with a log line), so that the drain ends, and says what it could not write, before
    vLLM kills the process.
    """
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(EXTRA_KEYS))
    if unknown:
        raise ConfigError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {list(EXTRA_KEYS)}")
    path = extra.get("config")
    user = extra.get("overrides") or {}
    if not isinstance(user, Mapping):
        raise ConfigError("kv_connector_extra_config.overrides must be a mapping")
    block_size = vllm_config.cache_config.block_size
    model = _model_section(vllm_config, kv_cache_config)
    parallel = parallel_section(vllm_config)
    base = load_config(path, overrides=user)
    if base.model.revision:
        model["revision"] = base.model.revision  # the operator's pin wins over the fingerprint
    elif fingerprint:
        digest = weights_fingerprint(vllm_config.model_config.model)
        revision = vllm_config.model_config.revision
        if digest is not None:
            model["revision"] = f"xxh3-128:{digest}"
        elif revision:
            model["revision"] = str(revision)
        else:
            log.warning("hicache: %s is not a local folder and has no revision: its KV is keyed by name only", model["name"])
    page_size = base.page_size if _explicit_page_size(path, user) else block_size
    if block_size % page_size:
        raise ConfigError(f"page_size {page_size} must divide vLLM's block_size {block_size}")
    sched = vllm_config.scheduler_config
    probe = load_config(path, overrides=_merge(user, {"model": model, "parallel": parallel, "page_size": page_size}))
    # With a host tier the connector copies between vLLM's blocks and host pages directly: the device
    # tier then holds nothing (one block: a pool has at least a page). Without one, pages live there.
    default = block_size if probe.tiers.host.capacity else vllm_config.model_config.max_model_len + sched.max_num_batched_tokens
    staging = int(extra.get("staging_tokens") or default)
    staging_pages = -(-staging // page_size)
    derived: dict[str, Any] = {
        "model": model,
        "parallel": parallel,
        "page_size": page_size,
        "tiers": {"device": {"capacity": staging_pages * probe.page_bytes, "device": device}},
    }
    kv_events = getattr(vllm_config, "kv_events_config", None)
    announce = extra.get("kv_events", True)  # false: vLLM's events only (its GPU blocks), none of hicache's
    if not isinstance(announce, bool):
        raise ConfigError(f"kv_connector_extra_config.kv_events must be true or false, not {announce!r}")
    if announce and kv_events is not None and kv_events.enable_kv_cache_events:
        if probe.model.layers.hybrid:
            log.info("hicache: KV events: a hybrid model's tiers are not announced (docs/routing.md); vLLM's own "
                     "events go on")
        else:  # vLLM publishes them with its own (events.py); its GPU blocks are its to announce
            derived["kv_events"] = {"enabled": True, "sink": "engine", "device": False}
    wanted = probe.controller.shutdown_timeout_s
    if max_shutdown_s is not None and wanted > max_shutdown_s:
        derived["controller"] = {"shutdown_timeout_s": max_shutdown_s}
        log.info(
            "hicache: the drain at shutdown is bounded at %.1f s (controller.shutdown_timeout_s=%.1f): vLLM kills "
            "its worker then; raise VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (and --shutdown-timeout) to give it more",
            max_shutdown_s, wanted,
        )
    config = load_config(path, overrides=_merge(user, derived))
    if config.model.layers.splits and _one_block_table(vllm_config):
        config = _whole_pages(config)
    role = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_role", None)
    if fingerprint and role == "kv_consumer" and config.tenant_key is None:
        log.warning(
            "hicache: a kv_consumer without a tenant_key takes kv_transfer_params from whoever reaches its API: "
            "without the key anyone who knows the model can make a hand-off's check, and so park a request up to "
            "pd.receive_timeout_s=%.0f s holding its blocks. Let only the proxy reach this server, or set "
            "tenant_key (the same on the prefill servers): then parameters not made by one are refused",
            _pd_options(extra.get("pd")).receive_timeout_s,
        )
    return config


def _one_block_table(vllm_config: Any) -> bool:
    """Whether vLLM's hybrid KV cache manager is off: one block table, every token's KV kept."""
    return vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is True


def _whole_pages(config: HiCacheConfig) -> HiCacheConfig:
    """``config`` with every storage tier storing whole pages (``split_layers: false``).

    With the hybrid manager off vLLM keeps every token's KV of every layer and serves those blocks
    from its own prefix cache again: a page read back without its sliding layers cannot go there
    (``BlockLayout.first_unfit`` cuts the load before it), so storage keeps each page whole.
    """
    if not any(t.split_layers for t in config.tiers.storage):
        return config
    log.info("hicache: vLLM's hybrid KV cache manager is off (one block table, every token's KV kept): storage "
             "tiers keep whole pages (split_layers: false)")
    storage = [t.model_copy(update={"split_layers": False}) for t in config.tiers.storage]
    return config.model_copy(update={"tiers": config.tiers.model_copy(update={"storage": storage})})


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out
