"""Typed, validated configuration for a hicache instance.

One frozen ``HiCacheConfig`` describes the model geometry, the tiers and the policies, so every
component reads the same numbers and nothing changes under a running cache. ``read_config``
layers (later wins, nested mappings deep-merged, lists replaced whole):

1. the defaults of the models below,
2. a YAML file, whose string values may use ``${VAR}`` or ``${VAR:-default}``,
3. ``HICACHE_<SECTION>__<FIELD>`` environment variables (``__`` separates path segments),
4. an ``overrides`` mapping from the caller.

Every failure is a ``ConfigError`` whose message says where the bad value came from (file,
environment variable or overrides) and names each offending field as a dotted path. Secret fields
(``tenant_key``, a backend's passwords, the password inside a URL) never appear in an error, a
repr or a dump. The YAML reader bounds its work (nesting depth, alias expansion, file size), so a
hostile file is a ``ConfigError``, never a hang or a ``RecursionError``.

This module describes; it imports no tier. A storage tier's ``kind`` names a backend whose own
settings this module does not know: they are checked by a ``BackendSettingsResolver`` the caller
passes (``backends=``). ``hicache.load_config`` (``containers.load_config``, the composition root)
passes the one that resolves kinds to backend classes, so a typo in a backend's settings is still a
``ConfigError`` when the config loads; without a resolver an entry's other keys are kept as given
and checked when the composition root builds the tier.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from fractions import Fraction
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from hicache.errors import ConfigError

from .config_yaml import MAX_YAML_BYTES, Budget, copy_tree, dotted, load_yaml, read_yaml, substitute
from .layer_kinds import LayerKinds
from .redaction import SECRET_MASK, SECRET_NAME, mask_url, redacted

if TYPE_CHECKING:
    import torch

__all__ = [
    "ENV_PREFIX", "SECRET_MASK", "BackendSettingsResolver", "ByteSize", "CodecConfig", "ControllerConfig",
    "DeviceTierConfig", "HiCacheConfig", "HostTierConfig", "IOConfig", "KVEventsConfig", "LoggingConfig", "ModelConfig",
    "ParallelConfig", "PoliciesConfig", "PrefetchTimeoutConfig", "StorageTierConfig", "TiersConfig",
    "format_size", "mask_url", "parse_size", "read_config", "storage_entry",
]

ENV_PREFIX = "HICACHE_"

_BINARY = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
_DECIMAL = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000))
_UNITS = {"": 1, "b": 1, **{name.lower(): unit for name, unit in _BINARY + _DECIMAL}}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")
_SIZE_HINT = "expected bytes or a string like '512MiB'"
MAX_SIZE = 2**60  # 1 EiB: larger byte counts are typos (1e30) and overflow the pools' page counts
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def parse_size(value: object, *, minimum: int = 1) -> int:
    """Turn ``4096``, ``"512MiB"``, ``"1.5 GiB"`` or ``"1GB"`` into a whole number of bytes (>= ``minimum``).

    Binary units (KiB..TiB) are powers of 1024, decimal ones (KB..TB) powers of 1000; units are
    case-insensitive. Exact fractions are used so ``"1.5GiB"`` never suffers float rounding.
    """
    amount: Fraction | None = None
    if isinstance(value, str):
        match = _SIZE_RE.fullmatch(value)
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if match and unit is not None:
            amount = Fraction(match.group(1)) * unit
    elif isinstance(value, int | float) and not isinstance(value, bool):
        if math.isfinite(value):
            amount = Fraction(value)
    if amount is None:
        raise ConfigError(f"invalid size {value!r} ({_SIZE_HINT})")
    if amount.denominator != 1:
        raise ConfigError(f"invalid size {value!r} (not a whole number of bytes)")
    if amount < minimum:
        raise ConfigError(f"invalid size {value!r} (must be at least {minimum} byte{'s' if minimum != 1 else ''})")
    if amount > MAX_SIZE:
        raise ConfigError(f"invalid size {value!r} (at most 1EiB)")
    return int(amount)


def format_size(n: int) -> str:
    """Spell a byte count readably (``"256MiB"``, ``"1.5KiB"``) in a form ``parse_size`` reads back.

    The shortest exact spelling wins (binary units with up to three decimals, decimal units whole);
    plain bytes only when no unit is exact.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"format_size needs a non-negative int, got {n!r}")
    spellings = [f"{n // unit}{name}" for name, unit in _DECIMAL if n and n % unit == 0]
    for name, unit in _BINARY:
        amount = Fraction(n, unit)
        if amount >= 1 and (amount * 1000).denominator == 1:
            spellings.append(f"{float(amount):.3f}".rstrip("0").rstrip(".") + name)
    return min(spellings, key=len) if spellings else f"{n}B"


def _check_device(value: str) -> str:
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ValueError(f"expected 'auto', 'cpu', 'cuda' or 'cuda:N', got {value!r}")
    return value


def _parse_pin_memory(value: object) -> object:
    if isinstance(value, bool) or value == "auto":
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"expected 'auto', true or false, got {value!r}")


def _no_bool(value: object) -> object:
    """``true`` is not a count: YAML booleans would otherwise pass as 1 and 0."""
    if isinstance(value, bool):
        raise ValueError(f"expected a whole number, got {value!r}")
    return value


def _parse_layers(value: object) -> LayerKinds:
    try:
        return LayerKinds.parse(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise PydanticCustomError("layer_kinds", str(exc)) from None


def _layers_out(value: LayerKinds) -> list[str]:
    return [k.text for k in value]


def _field_error(field: str, message: str) -> PydanticCustomError:
    """A cross-field error that still points at one field (``loc`` only names the model)."""
    return PydanticCustomError("hicache_field", message, {"field": field})


#: A byte count: an int, or a string such as ``"256MiB"``; dumped to JSON/YAML as such a string.
ByteSize = Annotated[int, BeforeValidator(parse_size), PlainSerializer(format_size, when_used="json")]
# 0 turns the host tier off: the device tier alone, as a RadixAttention engine without offloading.
_HostSize = Annotated[
    int, BeforeValidator(lambda v: parse_size(v, minimum=0)), PlainSerializer(format_size, when_used="json")
]
_Device = Annotated[str, AfterValidator(_check_device)]
_Int = Annotated[int, BeforeValidator(_no_bool)]
MAX_PAGE_SIZE = 2**20  # tokens per page
MAX_POOL_PAGES = 2**31  # pages in the device or host pool (its allocator keeps a flag per page)
MIN_TENANT_KEY_CHARS = 16
_PinMemory = Annotated[Literal["auto"] | bool, BeforeValidator(_parse_pin_memory)]
# hide_input_in_errors: a chained ValidationError (a traceback) must not print a secret either.
_FROZEN = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)


class ModelConfig(BaseModel):
    """The model whose KV is cached: its geometry sizes pages, its identity namespaces keys."""

    model_config = _FROZEN

    name: str = Field(default="example-model", min_length=1)
    num_layers: _Int = Field(default=8, ge=1)
    num_kv_heads: _Int = Field(default=2, ge=1)
    head_dim: _Int = Field(default=64, ge=1)
    dtype: Literal["float32", "float16", "bfloat16", "float64"] = "float32"
    attention: Literal["mha", "mla"] = "mha"
    revision: str = ""
    # Per layer: "full" or "sliding:<window>" (layer_kinds.py); empty: every layer full attention.
    layers: Annotated[LayerKinds, BeforeValidator(_parse_layers), PlainSerializer(_layers_out)] = LayerKinds()

    @model_validator(mode="after")
    def _geometry_agrees(self) -> ModelConfig:
        if self.attention == "mla" and self.num_kv_heads != 1:
            raise _field_error(
                "num_kv_heads",
                f"must be 1 when attention is 'mla' (one shared latent per token), got {self.num_kv_heads}",
            )
        if self.layers and len(self.layers) != self.num_layers:
            raise _field_error(
                "layers", f"lists {len(self.layers)} layers, but num_layers is {self.num_layers}"
            )
        return self

    @property
    def kv_components(self) -> int:
        """2 (K and V) for MHA, 1 (the shared latent) for MLA."""
        return 1 if self.attention == "mla" else 2

    @property
    def itemsize(self) -> int:
        """Bytes per element of ``dtype``, known without importing torch."""
        return _ITEMSIZE[self.dtype]

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``; torch is imported only when this is asked for."""
        import torch

        return getattr(torch, self.dtype)


class DeviceTierConfig(BaseModel):
    """The accelerator pool (L1): where the engine reads KV from."""

    model_config = _FROZEN

    capacity: ByteSize = 256 * 1024**2
    device: _Device = "auto"


class HostTierConfig(BaseModel):
    """The host-memory pool (L2) that device pages are backed up to and loaded back from."""

    model_config = _FROZEN

    capacity: _HostSize = 2 * 1024**3  # 0: no host tier
    layout: Literal["page_first", "layer_first"] = "page_first"
    pin_memory: _PinMemory = "auto"
    # Fault the tier's pages in from open on, in the background (Linux; tiers/prefault.py): for an
    # engine that writes fresh host pages on its critical path (the vLLM connector's saves).
    prefault: bool = False
    # A sliding-window hybrid's host pages shed their sliding layers' memory outside every window
    # before any page is evicted (tiers/shed.py). auto: where the pool can (unpinned, Linux);
    # false: pages stay whole.
    compact: bool | Literal["auto"] = "auto"


_CODEC_ROLES = {"int8": 0, "lossless": 1, "aes-gcm": 2}  # lossy, lossless, encryption: the order of a chain
_CODEC_OPTIONS: dict[str, set[str]] = {"int8": set(), "lossless": {"coder", "level"}, "aes-gcm": {"key"}}


class CodecConfig(BaseModel):
    """One stage of a storage tier's ``codec`` list (docs/codecs.md).

    Written as a name (``lossless``) or a mapping (``{kind: aes-gcm, key: "${PAGE_KEY}"}``; in a YAML
    flow mapping the ``${...}`` must be quoted):

    * ``int8``: 8-bit KV, K scaled per channel and V per token (lossy: its pages are another namespace);
    * ``lossless``: byte-shuffle + ``coder`` (``zstd`` at ``level``, or ``lz4``), from blosc2;
    * ``aes-gcm``: AES-256-GCM at rest; the key derives from ``tenant_key``, or from ``key`` when set.
    """

    model_config = _FROZEN

    kind: Literal["int8", "lossless", "aes-gcm"]
    coder: Literal["zstd", "lz4"] = "zstd"
    level: _Int = Field(default=1, ge=1, le=9)
    key: SecretStr | None = None

    @model_validator(mode="before")
    @classmethod
    def _name_alone(cls, value: object) -> object:
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("key", mode="before")
    @classmethod
    def _key_text(cls, value: object) -> object:
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise ValueError("must be a string (quote it in YAML); the value is not shown")
        if value == SECRET_MASK:
            raise ValueError("is the mask hicache prints in place of a secret, not a key: set the real key")
        if len(value) < MIN_TENANT_KEY_CHARS:
            raise ValueError(f"must be at least {MIN_TENANT_KEY_CHARS} characters (the value is not shown)")
        return value

    @model_validator(mode="after")
    def _options_of_its_kind(self) -> CodecConfig:
        for name in sorted(self.model_fields_set - _CODEC_OPTIONS[self.kind] - {"kind"}):
            raise _field_error(name, f"is not a setting of codec {self.kind!r}")
        return self

    @model_serializer(mode="wrap")
    def _own_options(self, handler: Any) -> Any:
        """Dumps name only the stage's own settings (so they load back)."""
        data = handler(self)
        if isinstance(data, dict):
            data = {k: v for k, v in data.items() if k == "kind" or k in _CODEC_OPTIONS[self.kind]}
            if data.get("key") is None:
                data.pop("key", None)
        return data


class BackendSettingsResolver(Protocol):
    """What a storage ``kind`` names, as far as validation needs: the backend's ``Settings`` model.

    Raises ``ConfigError`` for a kind it cannot resolve; ``class_paths=False`` (an entry from a
    request) must refuse a class path before importing anything. The composition root's is
    ``containers.backend_settings``.
    """

    def __call__(self, kind: str, *, class_paths: bool = True) -> type[BaseModel]: ...


class StorageTierConfig(BaseModel):
    """One storage tier below the host pool: ``kind`` picks the backend, the other keys configure it.

    ``kind`` is a built-in (``memory``, ``file``), the name of an installed plugin (entry-point group
    ``hicache.storage``) or a class path ``package.module:ClassName``. Validated with a resolver
    (``backends=``, as ``hicache.load_config`` does), every other key is checked against that
    backend's ``Settings``, so a typo is an error naming the field. An entry that came in a request
    is validated with ``REQUEST_CONTEXT`` (see ``storage_entry``).
    """

    model_config = ConfigDict(extra="allow", frozen=True, hide_input_in_errors=True)

    #: The backend's secret settings (its ``SecretStr`` fields), learnt from the resolver; ``None``
    #: when validated without one (then settings named like secrets are masked).
    _secrets: frozenset[str] | None = PrivateAttr(default=None)

    kind: str = Field(min_length=1)
    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_-]+$")
    #: Stages applied to every page on write, in order, and undone in reverse on read (none: the
    #: page is the KV itself, read and written in place).
    codec: list[CodecConfig] = Field(default_factory=list)
    #: For a model with full and sliding-window layers: store each page's sliding layers only near
    #: the ends of what is written (``tiers/storage/layer_split.py``); off: whole pages. Backends of
    #: one page size only keep whole pages either way.
    split_layers: bool = True

    @field_validator("codec", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, (str, dict)) else value

    @field_validator("codec")
    @classmethod
    def _chain_order(cls, stages: list[CodecConfig]) -> list[CodecConfig]:
        kinds = [c.kind for c in stages]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"each codec at most once, got {kinds}")
        if kinds != sorted(kinds, key=_CODEC_ROLES.__getitem__):
            raise ValueError(f"codecs go in the order int8, lossless, aes-gcm (quantise, compress, encrypt), got {kinds}")
        return stages

    @model_validator(mode="after")
    def _backend_settings(self, info: ValidationInfo) -> StorageTierConfig:
        context = dict(info.context or {})
        backends: BackendSettingsResolver | None = context.pop("backends", None)
        if backends is None:
            return self  # described only: the composition root checks the settings when it builds the tier
        try:
            settings = backends(self.kind, class_paths=context.get("class_paths", True))
        except ConfigError as exc:
            raise _field_error("kind", str(exc)) from None
        try:
            settings.model_validate(self.model_extra or {}, context=context or None)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc, message = _describe(err, secret=_is_secret(settings, tuple(err["loc"])))
            raise _field_error(dotted(loc), message) from None
        self._secrets = frozenset(
            name
            for name, field in settings.model_fields.items()
            if field.annotation is SecretStr or SecretStr in get_args(field.annotation)
        )
        return self

    def __eq__(self, other: object) -> bool:
        """Equal when they say the same: whether a resolver checked them does not change that."""
        if not isinstance(other, StorageTierConfig):
            return NotImplemented
        return (self.__dict__, self.__pydantic_extra__) == (other.__dict__, other.__pydantic_extra__)

    @model_serializer(mode="wrap")
    def _hide_secrets(self, handler: Any) -> Any:
        """Dumps (``hicache config``, benchmark JSON) never show a backend's secrets."""
        data = handler(self)
        if isinstance(data, dict):
            if not data.get("codec", True):
                del data["codec"]  # dumps of tiers without codecs stay as they were
            if data.get("split_layers") is True:
                del data["split_layers"]  # likewise the default
            for name in self._secret_fields():
                if data.get(name) is not None:
                    data[name] = SECRET_MASK
            for name, value in data.items():
                if isinstance(value, str) and "://" in value:
                    data[name] = mask_url(value)
        return data

    def __repr_args__(self) -> Any:
        secret = self._secret_fields()
        for name, value in super().__repr_args__():
            if name in secret and value is not None:
                value = SECRET_MASK
            elif isinstance(value, str) and "://" in value:
                value = mask_url(value)
            yield name, value

    def _secret_fields(self) -> set[str]:
        if self._secrets is not None:
            return set(self._secrets)
        return {name for name in self.model_extra or {} if SECRET_NAME.search(name)}

    @property
    def tier_name(self) -> str:
        return self.name or self.kind

    @property
    def options(self) -> dict[str, Any]:
        """The backend's own settings (every key but ``kind``, ``name`` and ``codec``)."""
        return dict(self.model_extra or {})


class TiersConfig(BaseModel):
    """All tiers, fastest first."""

    model_config = _FROZEN

    device: DeviceTierConfig = Field(default_factory=DeviceTierConfig)
    host: HostTierConfig = Field(default_factory=HostTierConfig)
    storage: list[StorageTierConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct_names(self) -> TiersConfig:
        seen = {"device", "host"}
        for i, tier in enumerate(self.storage):
            if tier.tier_name in seen:
                raise _field_error(
                    f"storage[{i}].name",
                    f"tier name {tier.tier_name!r} is taken (give each storage tier a distinct `name`)",
                )
            seen.add(tier.tier_name)
        return self


class PrefetchTimeoutConfig(BaseModel):
    """``timeout`` prefetch: wait ``min(max_s, base_s + per_ki_token_s * tokens / 1024)``."""

    model_config = _FROZEN

    base_s: float = Field(default=2.0, ge=0)
    per_ki_token_s: float = Field(default=0.1, ge=0)
    max_s: float = Field(default=30.0, gt=0)


class PoliciesConfig(BaseModel):
    """When pages are written down a tier, which pages are evicted first, how long to wait for storage."""

    model_config = _FROZEN

    write: Literal["write_through", "write_through_selective", "write_back"] = "write_through"
    write_threshold: _Int = Field(default=2, ge=1)
    eviction: Literal["lru", "lfu", "fifo", "priority", "scan_resistant_lru"] = "lru"
    prefetch: Literal["best_effort", "wait_complete", "timeout"] = "timeout"
    prefetch_threshold_tokens: _Int = Field(default=256, ge=0)
    prefetch_timeout: PrefetchTimeoutConfig = Field(default_factory=PrefetchTimeoutConfig)
    #: A sliding-window hybrid's layer-split storage tiers keep the sliding layers of the window
    #: before each prefix end and of this many tokens more, so a prompt that branches off that
    #: close before the end of a stored one (a second question on a document) is a hit there.
    window_slack_tokens: _Int = Field(default=128, ge=0)
    #: A recurrent model's engine checkpoints its layers' state every this many tokens (rounded
    #: down to whole pages) besides where each stored prompt ends: a prompt that branches off a
    #: stored one recomputes at most this much more. 0: checkpoints at prompt ends only.
    checkpoint_interval_tokens: _Int = Field(default=256, ge=0)


class IOConfig(BaseModel):
    """How pages are copied between tiers."""

    model_config = _FROZEN

    backend: Literal["kernel", "direct"] = "kernel"
    layerwise: bool = True


class ControllerConfig(BaseModel):
    """Bounds for the background workers, so memory and shutdown time stay predictable."""

    model_config = _FROZEN

    backup_queue: _Int = Field(default=64, ge=1)
    load_queue: _Int = Field(default=64, ge=1)
    high_watermark: float = Field(default=0.95, gt=0, le=1)
    low_watermark: float = Field(default=0.85, ge=0, lt=1)
    shutdown_timeout_s: float = Field(default=10.0, gt=0)
    io_threads: _Int = Field(default=2, ge=1)
    storage_queue: _Int = Field(default=64, ge=1)
    max_prefetches: _Int = Field(default=4, ge=1)
    storage_batch_bytes: ByteSize = 64 * 1024**2
    # How long an allocation may wait for in-flight copies to make room (backpressure) before a
    # store places fewer pages or a retrieve serves a shorter prefix.
    alloc_wait_s: float = Field(default=30.0, ge=0)

    @model_validator(mode="after")
    def _watermarks_ordered(self) -> ControllerConfig:
        if self.low_watermark >= self.high_watermark:
            raise _field_error(
                "low_watermark",
                f"must be below high_watermark ({self.high_watermark}), got {self.low_watermark}",
            )
        return self


class LoggingConfig(BaseModel):
    """How hicache logs (docs/operating.md, "Logs"); by default it leaves logging to the application."""

    model_config = _FROZEN

    # None: leave the "hicache" logger's level to the application.
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None = None
    # None: install no handler; text or json (one object per line): one stderr handler on "hicache".
    format: Literal["text", "json"] | None = None
    # A warning that can repeat per page (corrupt pages, failed writes) is logged once per interval and kind.
    repeat_interval_s: float = Field(default=60.0, ge=0)


class KVEventsConfig(BaseModel):
    """KV events for cache-aware routers (docs/routing.md): what each tier can serve, announced in
    vLLM's wire format (msgpack ``KVEventBatch`` on a ZMQ PUB socket, replay on a ROUTER socket)."""

    model_config = _FROZEN

    enabled: bool = False
    #: ``zmq``: hicache's own publisher (below); ``engine``: kept for the engine to publish with its
    #: own events (the vLLM connector sets it when vLLM's ``--kv-events-config`` enables events).
    sink: Literal["zmq", "engine"] = "zmq"
    #: Announce the device tier (off where the engine announces its own device blocks, as vLLM does).
    device: bool = True
    #: Where the PUB socket binds (``tcp://127.0.0.1:5557``; ``*`` for every interface).
    endpoint: str = "tcp://127.0.0.1:5557"
    #: Where the replay ROUTER socket binds; None: no replay.
    replay_endpoint: str | None = None
    topic: str = ""
    #: The PUB socket's send high-water mark: batches a slow subscriber may owe before ZMQ drops.
    hwm: _Int = Field(default=100_000, ge=0)
    #: Batches kept for replay (by sequence number).
    buffer_steps: _Int = Field(default=10_000, ge=1)
    #: Events waiting for the publisher thread; past it they are dropped and counted, never waited for.
    max_queue_size: _Int = Field(default=100_000, ge=1)
    #: A batch goes out when it has this many events or is this old.
    batch_events: _Int = Field(default=512, ge=1)
    batch_interval_s: float = Field(default=0.05, gt=0)
    #: ``data_parallel_rank`` of each batch (None: not set).
    data_parallel_rank: _Int | None = None
    #: Storage tiers (by name) shared by several instances: announced with the medium ``SHARED``;
    #: every other storage tier is this instance's ``DISK``. None: every tier but ``file``,
    #: ``memory`` and ``nixl`` ones is shared.
    shared_tiers: list[str] | None = None


class ParallelConfig(BaseModel):
    """Which slice of the model this rank's pages hold, for tensor- and pipeline-parallel engines.

    ``model.num_layers`` and ``model.num_kv_heads`` are what *this rank* holds (the geometry of its
    pages). Under TP a rank of an MHA/GQA model holds a slice of the KV heads (several ranks hold the
    same head when there are fewer KV heads than ranks); under PP a stage holds a range of layers;
    an MLA latent is the same on every TP rank. The namespace records the slice (``keys.Namespace``),
    so ranks never read each other's heads and a page is served only where the slice is the same.
    The defaults are a single rank holding the whole model.
    """

    model_config = _FROZEN

    tp_rank: _Int = Field(default=0, ge=0)
    tp_size: _Int = Field(default=1, ge=1)
    pp_rank: _Int = Field(default=0, ge=0)
    pp_size: _Int = Field(default=1, ge=1)
    #: The model layer this stage's first layer is (None: ``pp_rank * model.num_layers``, equal stages).
    first_layer: _Int | None = Field(default=None, ge=0)
    #: The model's KV heads over all TP ranks (None: ``model.num_kv_heads * tp_size``, no head replicated).
    total_kv_heads: _Int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _ranks_in_range(self) -> ParallelConfig:
        if self.tp_rank >= self.tp_size:
            raise _field_error("tp_rank", f"must be below tp_size ({self.tp_size}), got {self.tp_rank}")
        if self.pp_rank >= self.pp_size:
            raise _field_error("pp_rank", f"must be below pp_size ({self.pp_size}), got {self.pp_rank}")
        return self


class HiCacheConfig(BaseModel):
    """The root configuration; ``HiCacheConfig()`` is the packaged default."""

    model_config = _FROZEN

    model: ModelConfig = Field(default_factory=ModelConfig)
    page_size: _Int = Field(default=64, ge=1, le=MAX_PAGE_SIZE)
    tenant_salt: str = ""
    #: The tenant's secret: keys page names and a MAC over every page in storage (see
    #: docs/security.md). Empty or unset: no key (pages carry an unkeyed checksum, integrity only).
    tenant_key: SecretStr | None = None
    tiers: TiersConfig = Field(default_factory=TiersConfig)
    policies: PoliciesConfig = Field(default_factory=PoliciesConfig)
    io: IOConfig = Field(default_factory=IOConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    kv_events: KVEventsConfig = Field(default_factory=KVEventsConfig)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one layer of one page (K and V where present)."""
        m = self.model
        return m.kv_components * self.page_size * m.num_kv_heads * m.head_dim * m.itemsize

    @property
    def cache_layers(self) -> LayerKinds:
        """The layers of a page: the model's, each recurrent one as its checkpoint's ``state``
        layers (``LayerKinds.cache_layers``); empty when every layer is full attention."""
        return self.model.layers.cache_layers(self.slot_bytes)

    @property
    def num_cache_layers(self) -> int:
        """Layers of a page: ``model.num_layers`` unless some are recurrent."""
        return len(self.cache_layers) if self.model.layers.recurrent else self.model.num_layers

    @property
    def page_bytes(self) -> int:
        """Bytes one page of KV occupies in a tier (all cache layers, K and V where present)."""
        return self.num_cache_layers * self.slot_bytes

    @field_validator("tenant_key", mode="before")
    @classmethod
    def _tenant_key_text(cls, value: object) -> object:
        if value is None or isinstance(value, SecretStr):
            value = None if value is None else value.get_secret_value()
        if value is None or value == "":
            return None
        if not isinstance(value, str):
            raise ValueError("must be a string (quote it in YAML); the value is not shown")
        if value == SECRET_MASK:
            raise ValueError(
                "is the mask hicache prints in place of a secret, not a key: set the real key "
                "(e.g. HICACHE_TENANT_KEY)"
            )
        if len(value) < MIN_TENANT_KEY_CHARS:
            raise ValueError(
                f"must be at least {MIN_TENANT_KEY_CHARS} characters (the value is not shown); make one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )
        return value

    @model_validator(mode="after")
    def _pools_hold_pages(self) -> HiCacheConfig:
        page = self.page_bytes
        device, host = self.tiers.device.capacity, self.tiers.host.capacity
        if device < page:
            raise _field_error(
                "tiers.device.capacity",
                f"must hold at least one page ({format_size(page)}: page_size x layers x heads x head_dim x "
                f"dtype bytes, K and V), got {format_size(device)}: raise it or lower page_size",
            )
        if 0 < host < page:
            raise _field_error(
                "tiers.host.capacity",
                f"must be 0 (no host tier) or hold at least one page ({format_size(page)}), got {format_size(host)}",
            )
        for name, capacity in (("device", device), ("host", host)):
            if capacity // page > MAX_POOL_PAGES:
                raise _field_error(
                    f"tiers.{name}.capacity",
                    f"holds {capacity // page} pages, more than a pool indexes ({MAX_POOL_PAGES}): "
                    "lower it or raise page_size",
                )
        return self

    @model_validator(mode="after")
    def _encryption_has_a_key(self) -> HiCacheConfig:
        for i, tier in enumerate(self.tiers.storage):
            for j, stage in enumerate(tier.codec):
                if stage.kind == "aes-gcm" and stage.key is None and self.tenant_key is None:
                    raise _field_error(
                        f"tiers.storage[{i}].codec[{j}]",
                        "aes-gcm needs a key: set tenant_key (the page key derives from it), or the codec's own `key`",
                    )
        return self

    @model_validator(mode="after")
    def _storage_needs_host(self) -> HiCacheConfig:
        if self.tiers.storage and self.tiers.host.capacity < self.page_bytes:
            raise _field_error(
                "tiers.host.capacity",
                f"storage tiers are written and read through the host tier: give it at least one page "
                f"({format_size(self.page_bytes)}), got {format_size(self.tiers.host.capacity)}",
            )
        return self

    @model_validator(mode="after")
    def _heads_split_evenly(self) -> HiCacheConfig:
        p, heads = self.parallel, self.model.num_kv_heads
        if self.model.attention == "mla" or p.total_kv_heads is None:
            return self  # MLA: every rank holds the one latent; None: heads x tp_size by definition
        total, tp = p.total_kv_heads, p.tp_size
        if total >= tp and (total % tp or heads != total // tp):
            raise _field_error(
                "parallel.total_kv_heads",
                f"{total} KV heads over {tp} ranks is {total / tp:g} a rank, but model.num_kv_heads "
                f"(the heads this rank holds) is {heads}",
            )
        if total < tp and (tp % total or heads != 1):
            raise _field_error(
                "parallel.total_kv_heads",
                f"{total} KV heads over {tp} ranks: each rank holds one head replicated on {tp / total:g} "
                f"ranks (tp_size must be a multiple of it), and model.num_kv_heads must be 1, got {heads}",
            )
        return self

    def to_yaml(self) -> str:
        """Dump as YAML that ``read_config`` (and ``hicache.load_config``) reads back to an equal config."""
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# --------------------------------------------------------------------------- loading


def read_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    backends: BackendSettingsResolver | None = None,
) -> HiCacheConfig:
    """Build a config from defaults, ``path``, ``HICACHE_*`` variables in ``env``, ``overrides``.

    ``env`` defaults to ``os.environ``; pass a mapping to keep loading independent of the process.
    ``backends`` checks each storage tier's backend settings (see the module docstring): what
    ``hicache.load_config`` passes. Without it they are checked when the tier is built.
    """
    environ = os.environ if env is None else env
    source = None if path is None else os.fspath(path)
    labels: dict[tuple[Any, ...], str] = {}  # leaf path -> where its value came from
    data: dict[str, Any] = {}
    try:
        if source is not None:
            data = substitute(read_yaml(source), environ, source, (), Budget(source))
            labels.update((leaf, source) for leaf in _leaves(data, ()))
        data = _merge(data, _env_layer(environ, labels))
        if overrides is not None:
            if not isinstance(overrides, Mapping):
                raise ConfigError(f"overrides: expected a mapping of settings, got {type(overrides).__name__}")
            layer = _merge({}, overrides)  # also turns nested Mappings into dicts
            labels.update((leaf, "overrides") for leaf in _leaves(layer, ()))
            data = _merge(data, layer)
    except RecursionError:  # a self-referencing mapping passed as overrides
        raise ConfigError("the settings nest too deeply (a mapping that contains itself?)") from None
    try:
        return HiCacheConfig.model_validate(data, context=None if backends is None else {"backends": backends})
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            loc, message = _describe(err, secret=_is_secret(HiCacheConfig, loc))
            origin = _origin(loc, labels, source)
            lines.append(f"{origin}: {dotted(loc)}: {message}" if origin else f"{dotted(loc)}: {message}")
        raise ConfigError("\n".join(lines)) from exc
    except RecursionError:
        raise ConfigError("the settings nest too deeply") from None


#: How an entry that came in a request (the admin endpoint) is validated, rather than one of the
#: process's own configuration: ``kind`` must be a built-in or an installed plugin (a class path is
#: refused before anything is imported), and the backend's settings read nothing from this process's
#: environment (``environ``: none; ``tiers.storage.base.settings_environ``): a file tier's ``$VAR``
#: are unset variables, an s3 tier takes no ``AWS_*`` credentials. The tier is then built from the
#: validated entry like any other: validation already refused whatever would have read the environment.
REQUEST_CONTEXT: Mapping[str, Any] = MappingProxyType({"class_paths": False, "environ": MappingProxyType({})})


def storage_entry(
    entry: Mapping[str, Any],
    where: str = "storage entry",
    *,
    from_request: bool = False,
    backends: BackendSettingsResolver | None = None,
) -> StorageTierConfig:
    """Validate one ``tiers.storage`` item (a dict, as in YAML) as ``read_config`` would: a
    ``ConfigError`` naming ``where`` and the field, secrets never shown. No ``${VAR}`` expansion:
    the caller passes values, not a file. ``from_request``: the entry came from outside the process
    (``REQUEST_CONTEXT``). ``backends``: as for ``read_config``."""
    if from_request and backends is None:
        # Its kind must be resolved here, with class paths refused: nothing may import one later.
        raise TypeError("storage_entry(from_request=True) needs the resolver (backends=)")
    if not isinstance(entry, Mapping):
        raise ConfigError(f"{where}: expected a mapping like {{kind: file, path: ...}}, got {type(entry).__name__}")
    context: dict[str, Any] = dict(REQUEST_CONTEXT) if from_request else {}
    if backends is not None:
        context["backends"] = backends
    try:
        return StorageTierConfig.model_validate(dict(entry), context=context or None)
    except ValidationError as exc:
        lines = []
        for err in exc.errors(include_url=False):
            loc, message = _describe(err, secret=_is_secret(StorageTierConfig, tuple(err["loc"])))
            lines.append(f"{where}: {dotted(loc) or '(entry)'}: {message}")
        raise ConfigError("\n".join(lines)) from None


def _origin(loc: tuple[Any, ...], labels: Mapping[tuple[Any, ...], str], source: str | None) -> str | None:
    """Where the value at ``loc`` came from: the layer that set it, else the file (if any)."""
    for k in range(len(loc), 0, -1):
        if loc[:k] in labels:
            return labels[loc[:k]]
    # A cross-field error may point at a field nobody set; blame its siblings if one layer set them.
    siblings = {label for key, label in labels.items() if key[: len(loc) - 1] == loc[:-1]}
    return siblings.pop() if len(loc) > 1 and len(siblings) == 1 else source


def _env_layer(env: Mapping[str, str], labels: dict[tuple[Any, ...], str]) -> dict[str, Any]:
    """Collect ``HICACHE_A__B=v`` as ``{"a": {"b": v}}``; other ``HICACHE_*`` names are ignored."""
    layer: dict[str, Any] = {}
    for name in sorted(env):
        if not name.upper().startswith(ENV_PREFIX):
            continue
        path = tuple(name[len(ENV_PREFIX) :].lower().split("__"))
        if path[0] not in HiCacheConfig.model_fields:
            continue  # e.g. HICACHE_REDIS_PASSWORD, used by ${...} substitution instead
        if not all(path):
            raise ConfigError(
                f"environment variable {name}: empty path segment "
                "(separate names with double underscores, e.g. HICACHE_TIERS__HOST__CAPACITY)"
            )
        raw = env[name]
        value = raw if _wants_string(path) else _parse_env_value(raw, name)
        node = layer
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[path[-1]] = value
        labels.update((leaf, f"environment variable {name}") for leaf in _leaves(value, path))
    return layer


def _wants_string(path: tuple[str, ...]) -> bool:
    """True when the field at ``path`` takes a string, so ``"0123"`` must not become an int."""
    model: Any = HiCacheConfig
    annotation: Any = None
    for part in path:
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        annotation = model = model.model_fields[part].annotation
    if annotation in (str, SecretStr):
        return True
    args = get_args(annotation)
    if args and all(a in (str, SecretStr, type(None)) for a in args):  # str | None, SecretStr | None
        return True
    return get_origin(annotation) is Literal and all(isinstance(a, str) for a in args)


def _parse_env_value(raw: str, name: str) -> Any:
    where = f"environment variable {name}"
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"{where}: longer than {MAX_YAML_BYTES // 1024} KiB")
    try:
        value = load_yaml(raw, where)
    except yaml.YAMLError:
        return raw  # not YAML: the string itself
    if value is None:
        return raw
    return copy_tree(value, (), Budget(where))


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge ``top`` over ``base`` into a new dict; non-mapping values (lists too) replace."""
    out = dict(base)
    for key, value in top.items():
        old = out.get(key)
        if isinstance(value, Mapping):
            value = _merge(old if isinstance(old, dict) else {}, value)
        out[key] = value
    return out


def _leaves(value: Any, prefix: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict) and value:
        for key, sub in value.items():
            yield from _leaves(sub, (*prefix, key))
    else:
        yield prefix


def _is_secret(model: Any, loc: tuple[Any, ...]) -> bool:
    """True when ``loc`` (in ``model``) is a secret field, or is named like one."""
    for part in loc:
        if isinstance(part, str) and SECRET_NAME.search(part):
            return True
    annotation: Any = None
    for part in loc:
        if isinstance(part, int):
            continue
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or part not in model.model_fields:
            return False
        annotation = model.model_fields[part].annotation
        model = next((a for a in (annotation, *get_args(annotation)) if isinstance(a, type)), annotation)
    return annotation is SecretStr or SecretStr in get_args(annotation)


def _describe(err: Any, *, secret: bool = False) -> tuple[tuple[Any, ...], str]:
    """Turn one pydantic error into (location, human message); a ``secret`` value is never shown."""
    loc, kind, ctx = tuple(err["loc"]), err["type"], err.get("ctx") or {}
    if secret:
        got = f"a value of type {type(err.get('input')).__name__} (not shown: a secret)"
    else:
        got = repr(redacted(err.get("input")))
        got = got if len(got) <= 80 else got[:77] + "..."
    if kind == "hicache_field":
        return (*loc, *ctx["field"].split(".")), err["msg"]
    if kind == "extra_forbidden":
        return loc, "unknown setting"
    if kind == "missing":
        return loc, "required setting is missing"
    if kind == "literal_error":
        choices = ", ".join(re.findall(r"'[^']*'", str(ctx.get("expected"))))
        return loc, f"expected one of {choices}, got {got}"
    if kind == "value_error":
        message = str(ctx.get("error", err["msg"]))
        return loc, mask_url(message) if "://" in message else message
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return loc, f"expected a mapping of settings, got {got}"
    message = err["msg"]
    if message.startswith("Input should be "):
        message = "expected " + message[len("Input should be ") :]
    return loc, f"{message}, got {got}"
