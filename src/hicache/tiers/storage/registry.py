"""Which class a storage tier's ``kind`` names: a built-in, an installed plugin, or a class path.

Resolution order for ``kind``:

1. a built-in name (``memory``, ``file``, ``redis``, ``mooncake``, ``s3``, ``nixl``, ``nixl-peer``);
2. an entry point named ``kind`` in the group ``hicache.storage`` of any installed distribution,
   e.g. in the plugin's ``pyproject.toml``::

       [project.entry-points."hicache.storage"]
       mystore = "mystore.backend:MyStoreBackend"

3. a dotted class path, ``"package.module:ClassName"`` (or ``"package.module.ClassName"``): only
   for the process's own configuration (``class_paths=True``). An entry that came in a request (the
   admin endpoint) names a built-in or an installed plugin, and a class path is refused before
   anything is imported: importing a module runs its code.

The class must subclass ``StorageBackend``. Built-ins are imported lazily, so a backend whose
client library is missing costs nothing until it is chosen.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from ...errors import ConfigError
from .base import StorageBackend

__all__ = ["BUILTIN_BACKENDS", "ENTRY_POINT_GROUP", "resolve_backend", "available_backends"]

ENTRY_POINT_GROUP = "hicache.storage"
BUILTIN_BACKENDS = {
    "memory": "hicache.tiers.storage.memory:MemoryBackend",
    "file": "hicache.tiers.storage.file:FileBackend",
    "redis": "hicache.tiers.storage.redis:RedisBackend",  # needs the `redis` extra
    "mooncake": "hicache.tiers.storage.mooncake:MooncakeBackend",  # needs the `mooncake` extra
    "s3": "hicache.tiers.storage.s3:S3Backend",  # needs the `s3` extra
    "nixl": "hicache.tiers.storage.nixl.posix:NixlFileBackend",  # needs the `nixl` extra
    "nixl-peer": "hicache.tiers.storage.nixl.peer:NixlPeerBackend",  # needs the `nixl` extra
}


def available_backends() -> list[str]:
    """Built-in names, then the names of installed plugins."""
    plugins = sorted(ep.name for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in BUILTIN_BACKENDS)
    return [*BUILTIN_BACKENDS, *plugins]


def _import(target: str) -> object:
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise ConfigError(f"{target!r} is not a class path (write 'package.module:ClassName')")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for storage backend {target!r}: {exc}") from exc
    obj = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(f"{module_name!r} has no attribute {attr!r}") from exc
    return obj


def resolve_backend(kind: str, *, class_paths: bool = True) -> type[StorageBackend]:
    """The backend class for ``kind``; ``ConfigError`` saying what is available if there is none.

    ``class_paths=False``: built-in kinds and installed plugins only (nothing else is imported).
    """
    if kind in BUILTIN_BACKENDS:
        cls = _import(BUILTIN_BACKENDS[kind])
    else:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == kind]
        if found:
            try:
                cls = found[0].load()
            except Exception as exc:  # a broken plugin: say which one
                raise ConfigError(f"storage plugin {kind!r} ({found[0].value}) failed to load: {exc!r}") from exc
        elif not class_paths:
            raise ConfigError(
                f"unknown storage backend {kind!r} (available: {', '.join(available_backends())}); a class path "
                "is taken from the process's own configuration only, never from a request"
            )
        elif ":" in kind or "." in kind:
            cls = _import(kind)
        else:
            raise ConfigError(
                f"unknown storage backend {kind!r} (available: {', '.join(available_backends())}; "
                "or a class path 'package.module:ClassName')"
            )
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigError(f"{kind!r} resolves to {cls!r}, which is not a hicache StorageBackend subclass")
    return cls
