"""The backend's settings (from SGLang's extra config) and the hicache config of one SGLang rank.

``--hicache-storage-backend-extra-config`` carries, besides SGLang's own keys (``backend_name``,
``module_path``, ``class_name``, ``interface_v1``, the prefetch knobs; ignored here):

* ``config``: a hicache YAML file (its ``tiers.storage``, ``tenant_key``, ``model.revision``, ...);
* ``overrides``: a mapping merged over it (same shape as the YAML);
* ``storage``: the storage entries inline (a list, as ``tiers.storage`` in YAML), instead of a file;
* ``timeout_s``: the longest one SGLang call may wait for storage (default 30; a call that runs out
  is a miss, or an unwritten page);
* ``metrics_port`` / ``metrics_host``: serve hicache's Prometheus metrics there (default: none;
  host ``127.0.0.1``; a rank listens on ``metrics_port + pp_rank * tp_size + tp_rank``; 0: any free port);
* ``dump_config``: a path to write the effective hicache config to (secrets masked), for
  ``hicache inspect`` (``{tp_rank}`` and ``{pp_rank}`` in it are filled in);
* ``clear``: what SGLang's ``/hicache/storage-backend/clear`` removes (``clear.py``): ``namespace``
  (default) this rank's pages only, found as ``hicache inspect purge --namespace this`` finds them
  (other models', layouts' and tenants' pages on a shared tier stay); ``all`` every page of every
  tier, whoever wrote it; ``off`` nothing. SGLang serves that endpoint to anyone who reaches its
  port unless ``--admin-api-key`` is set.

Keys it does not know are logged and ignored, so an SGLang release that passes a new one never
fails the backend; a value it knows and cannot use is a ``ConfigError`` when SGLang builds it.

The hicache config of a rank (``cache_config_for``) takes the user's YAML and overrides, then fills
what SGLang knows: the model's name (``HiCacheStorageConfig.model_name``, unless the config names
the model: an explicit ``model.name`` wins, so engines that serve one model under different names
can share pages), its KV geometry as this rank holds it (from the host pool), the page size, the
page byte order of the host layout, and the parallel layout (``tp_rank``/``tp_size``,
``pp_rank``/``pp_size``, the stage's first layer; ``is_mla_model``). Attention context parallelism
(``attn_cp_size > 1``) adds the CP rank to the model's name: each CP rank holds its own slice.

The model's ``revision`` is the weights' fingerprint, as the vLLM connector makes it
(``weights_fingerprint``: xxh3-128 over the weight files of a local model folder), unless the
config pins ``model.revision``: so KV of other weights under the same name is never served. The
folder is SGLang's ``--model-path`` (from its runtime context), else the model's name when that is
a folder (SGLang's served name defaults to the path). A model SGLang loads from the Hub by id has
no local folder to read: SGLang's ``--revision`` is used if set, else its pages are keyed by name
alone, and a warning at start says so.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...config import HiCacheConfig
from ...containers import load_config
from ...errors import ConfigError, UnsupportedModelError
from ..vllm.settings import weights_fingerprint  # the vLLM connector's own: one fingerprint for one set of weights
from .host_pages import PAGE_ORDERS

__all__ = [
    "BackendSettings", "SGLANG_KEYS", "backend_settings", "cache_config_for", "check_model_name", "user_config",
    "weights_revision",
]

log = logging.getLogger("hicache.sglang")

#: Keys of the extra config that SGLang itself reads (some it removes before the backend sees them).
SGLANG_KEYS = frozenset(
    {
        "backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold", "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token", "prefetch_timeout_max", "hicache_storage_pass_prefix_keys", "tp_lcm_size",
    }
)
_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: The host pools whose pages the backend knows how to lay out (``host_pages.py``), exactly these classes.
_POOLS = {"MHATokenToKVPoolHost": "mha", "MLATokenToKVPoolHost": "mla"}


class BackendSettings(BaseModel):
    """The backend's own keys of the extra config (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: str | None = None
    overrides: dict[str, Any] = Field(default_factory=dict)
    storage: list[dict[str, Any]] | None = None
    timeout_s: float = Field(default=30.0, gt=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    dump_config: str | None = None
    clear: Literal["namespace", "all", "off"] = "namespace"


def backend_settings(extra: Mapping[str, Any] | None) -> BackendSettings:
    """Our keys of SGLang's extra config, validated; unknown keys logged and ignored."""
    extra = dict(extra or {})
    ours = {k: v for k, v in extra.items() if k in BackendSettings.model_fields and v is not None}
    unknown = sorted(set(extra) - set(BackendSettings.model_fields) - SGLANG_KEYS)
    if unknown:
        log.warning(
            "hicache: ignoring unknown key(s) %s of the extra config (known: %s)",
            unknown, sorted(BackendSettings.model_fields),
        )
    try:
        return BackendSettings.model_validate(ours)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(settings)'}: {e['msg']}" for e in exc.errors(include_url=False)
        )
        raise ConfigError(f"--hicache-storage-backend-extra-config: {problems}") from None


def user_config(settings: BackendSettings) -> HiCacheConfig:
    """The user's config alone (YAML, ``HICACHE_*`` variables, overrides, inline storage): checked
    when SGLang builds the backend, before any geometry is known."""
    if settings.config is not None and not Path(settings.config).expanduser().is_file():
        raise ConfigError(f"extra config `config`: no hicache config file at {settings.config!r}")
    # The heads a rank holds come from the host pool, later: the total is checked against them then.
    config = load_config(settings.config, overrides=_merge(_overrides(settings), {"parallel": {"total_kv_heads": None}}))
    if not config.tiers.storage:
        raise ConfigError(
            "hicache's SGLang backend needs at least one storage tier: give `storage: [{kind: file, path: ...}]` "
            "in the extra config, or tiers.storage in the YAML named by `config`"
        )
    return config


def check_model_name(user: HiCacheConfig, storage_config: Any) -> str:
    """The model's name: the config's ``model.name`` if it sets one, else SGLang's; one there must be."""
    name = user.model.name if "name" in user.model.model_fields_set else getattr(storage_config, "model_name", None)
    if not name:
        raise ConfigError(
            "SGLang passed no model name (HiCacheStorageConfig.model_name is None): name the model in the hicache "
            "config (model.name), or pages of different models could meet"
        )
    return str(name)


def _model_section(storage_config: Any, pool: Any, user: HiCacheConfig) -> dict[str, Any]:
    mla = bool(getattr(storage_config, "is_mla_model", False))
    attention = "mla" if mla else "mha"
    kind = type(pool).__name__
    if _POOLS.get(kind) != attention:
        raise UnsupportedModelError(
            f"SGLang host pool {kind} ({'MLA' if mla else 'MHA'} model): hicache's backend serves "
            f"{' and '.join(f'{k} ({a.upper()})' for k, a in _POOLS.items())}; hybrid, sparse and K-only pools "
            "need SGLang's own backends"
        )
    layout = getattr(pool, "layout", None)
    if (attention, layout) not in PAGE_ORDERS:
        raise UnsupportedModelError(f"SGLang host layout {layout!r} ({attention.upper()}) is not supported")
    dtype = _DTYPES.get(getattr(pool, "dtype", None))
    if dtype is None:
        raise UnsupportedModelError(
            f"SGLang KV dtype {getattr(pool, 'dtype', None)}: hicache's backend supports {sorted(_DTYPES.values())}"
        )
    if int(getattr(pool, "dcp_size", 1) or 1) != 1:
        raise UnsupportedModelError("decode context parallelism (dcp_size > 1) is not supported by hicache's backend")
    if mla:
        heads, head_dim = 1, int(pool.kv_cache_dim)
    else:
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
        if int(getattr(pool, "v_head_dim", head_dim)) != head_dim:
            raise UnsupportedModelError(
                f"K head dim {head_dim} != V head dim {pool.v_head_dim}: hicache's backend stores K and V alike"
            )
    name = f"{check_model_name(user, storage_config)}|sglang-{PAGE_ORDERS[(attention, layout)]}"
    cp_size = int(getattr(storage_config, "attn_cp_size", 1) or 1)
    if cp_size > 1:
        name += f"|cp={int(storage_config.attn_cp_rank or 0)}/{cp_size}"
    return {
        "name": name,
        "num_layers": int(pool.layer_num),
        "num_kv_heads": heads,
        "head_dim": head_dim,
        "dtype": dtype,
        "attention": attention,
    }


def cache_config_for(settings: BackendSettings, storage_config: Any, pool: Any) -> HiCacheConfig:
    """The hicache config of this SGLang rank (see the module docstring)."""
    user = user_config(settings)
    model = _model_section(storage_config, pool, user)
    tp_size = int(storage_config.tp_size or 1)
    pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
    parallel: dict[str, Any] = {
        "tp_rank": int(storage_config.tp_rank or 0),
        "tp_size": tp_size,
        "pp_rank": int(getattr(storage_config, "pp_rank", 0) or 0),
        "pp_size": pp_size,
        "first_layer": int(getattr(pool, "start_layer", 0) or 0),
        # total_kv_heads is the user's to state (replicated heads), from the YAML or the overrides.
    }
    page_size = int(pool.page_size)
    probe = load_config(
        settings.config, overrides=_merge(_overrides(settings), {"model": model, "page_size": page_size, "parallel": parallel})
    )
    revision = user.model.revision or weights_revision(storage_config)
    derived = {
        "model": {**model, "revision": revision},
        "page_size": page_size,
        "parallel": parallel,
        # Unused by the backend (SGLang owns device and host memory); one page each keeps the config valid.
        "tiers": {"device": {"capacity": probe.page_bytes}, "host": {"capacity": probe.page_bytes}},
    }
    config = load_config(settings.config, overrides=_merge(_overrides(settings), derived))
    if not revision:
        log.warning(
            "hicache: pages of %s are keyed by its name alone: no local model folder to fingerprint and no "
            "--revision, so KV of other weights under this name would be served; set model.revision in the "
            "hicache config (a release tag, a commit) to pin the weights", model["name"],
        )
    return config


def weights_revision(storage_config: Any) -> str:
    """The revision of the weights SGLang serves: the fingerprint of its local model folder, else
    SGLang's ``--revision``, else ``""`` (none known)."""
    path, revision = _sglang_model()
    for folder in dict.fromkeys((path, getattr(storage_config, "model_name", None))):
        if folder and Path(str(folder)).expanduser().is_dir():
            fingerprint = weights_fingerprint(Path(str(folder)).expanduser())
            if fingerprint is not None:
                return f"xxh3-128:{fingerprint}"
    return str(revision or "")


def _sglang_model() -> tuple[str | None, str | None]:
    """SGLang's ``--model-path`` and ``--revision`` from its runtime context (``(None, None)`` where
    it has published none, as in a bare test, or an SGLang release without it)."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
        return getattr(bag, "model_path", None), getattr(bag, "revision", None)
    except Exception:  # noqa: BLE001 - not published, or another SGLang: the name is the fallback
        return None, None


def _overrides(settings: BackendSettings) -> dict[str, Any]:
    overrides = dict(settings.overrides)
    if settings.storage is not None:
        overrides = _merge(overrides, {"tiers": {"storage": settings.storage}})
    return overrides


def _merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out
