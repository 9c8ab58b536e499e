"""The codec interface: one stage of a storage tier's codec chain, and the chain itself.

A storage tier's ``codec:`` list (config) is a chain of stages applied in order on write and in
reverse on read, between the host page and the backend. Each stage is a ``Codec``: bytes in, bytes
out, pure CPU work that the tier runs in worker threads, one page per task, never on the copy path
between device and host. Three roles, at most one stage of each, in this order:

1. ``lossy`` (``int8``): quantises the KV; pages written with it live in another namespace
   (``PageCodec`` derives their names and namespace field from it), so an exact reader never
   receives one;
2. ``lossless`` (``lossless``): byte-shuffle and an entropy coder;
3. ``encryption`` (``aes-gcm``): AES-256-GCM; its tag authenticates the page, standing in for
   the checksum or MAC.

Each stage has a one-byte ``id`` that the page's header records (``page_format``), so a reader
decodes what the header says was applied, and refuses (a miss) a page with a stage it does not
know, a lossy stage that is not its own, or encryption it has no key for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from ...base import KVGeometry

__all__ = ["Codec", "CodecChain", "CodecError", "PageContext", "Role"]

Role = Literal["lossy", "lossless", "encryption"]
_ORDER: dict[str, int] = {"lossy": 0, "lossless": 1, "encryption": 2}
MAX_STAGES = 4  # ids in the header


class CodecError(Exception):
    """A stored page that a stage cannot decode (corrupt, foreign, wrong key): the page is a miss."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class PageContext:
    """What a stage may need to know about the page it codes.

    ``aad`` is the associated data an encrypting stage authenticates (the header's fields: magic,
    format, namespace field, storage name, geometry, dtype, codec ids); ``decoded_bytes`` is the
    size the stage's decode must produce when it is known in advance (``None``: the stage knows it
    from its own framing, bounded by ``max_decoded_bytes``).
    """

    geometry: KVGeometry
    aad: bytes
    itemsize: int  # bytes per element of the stage's input (a lossless stage shuffles by it)
    decoded_bytes: int | None
    max_decoded_bytes: int


class Codec(ABC):
    """One stage: ``encode`` on write, ``decode`` on read; both run in worker threads."""

    #: Stage name in the config (``codec: [lossless, aes-gcm]``) and in ``hicache inspect``.
    name: ClassVar[str]
    #: The byte the header records (never reused for another format).
    id: ClassVar[int]
    role: ClassVar[Role]

    @property
    def variant(self) -> str:
        """What distinguishes this stage's pages in the namespace (its name; a key's fingerprint too)."""
        return self.name

    @abstractmethod
    def encoded_bytes(self, n: int) -> int | None:
        """The stage's output size for ``n`` input bytes where it is fixed (lossy, encryption), else ``None``."""

    @abstractmethod
    def max_encoded_bytes(self, n: int) -> int:
        """An upper bound of the output size for ``n`` input bytes (sizes the read buffers)."""

    def output_itemsize(self, itemsize: int) -> int:
        """Bytes per element of the output, for the next stage's shuffle (default: opaque bytes)."""
        return 1

    @abstractmethod
    def encode(self, data: memoryview, page: PageContext) -> memoryview | bytes:
        """The stage's output for ``data`` (contiguous bytes)."""

    @abstractmethod
    def decode(self, data: memoryview, page: PageContext, out: memoryview | None) -> memoryview | bytes:
        """Undo ``encode``; raise ``CodecError`` when ``data`` is not something it wrote.

        ``out``, when given, is a writable buffer of exactly ``page.decoded_bytes`` bytes: a stage
        that can decode in place writes there and returns it (no copy), others return their own.
        """

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


class CodecChain:
    """The ordered stages of one tier (possibly none), with the size of each intermediate form."""

    def __init__(self, stages: Sequence[Codec] = ()) -> None:
        stages = tuple(stages)
        roles = [s.role for s in stages]
        if len(set(roles)) != len(roles):
            raise ValueError("a codec chain has at most one stage of each kind (lossy, lossless, encryption)")
        if roles != sorted(roles, key=_ORDER.__getitem__):
            raise ValueError("codec stages go in the order lossy, lossless, encryption")
        if len(stages) > MAX_STAGES:
            raise ValueError(f"at most {MAX_STAGES} codec stages")
        self.stages = stages

    def __bool__(self) -> bool:
        return bool(self.stages)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.stages)

    @property
    def ids(self) -> bytes:
        return bytes(s.id for s in self.stages)

    @property
    def variant(self) -> str:
        """What makes this chain's pages interchangeable only with its own (the namespace variant)."""
        return ",".join(s.variant for s in self.stages)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.stages)

    def of_role(self, role: Role) -> Codec | None:
        return next((s for s in self.stages if s.role == role), None)

    @property
    def lossy(self) -> Codec | None:
        return self.of_role("lossy")

    @property
    def encryption(self) -> Codec | None:
        return self.of_role("encryption")

    def max_stored_bytes(self, logical: int) -> int:
        n = logical
        for s in self.stages:
            n = s.max_encoded_bytes(n)
        return n

    def __repr__(self) -> str:
        return f"CodecChain({list(self.names)})"


def run_encode(stages: Sequence[Codec], data: memoryview, geometry: KVGeometry, aad: bytes) -> memoryview | bytes:
    """``data`` (the page's logical payload) through every stage in order: the stored payload."""
    out: memoryview | bytes = data
    itemsize = geometry.dtype.itemsize
    for stage in stages:
        n = len(out)
        ctx = PageContext(geometry, aad, itemsize, n, n)
        out = stage.encode(memoryview(out), ctx)
        itemsize = stage.output_itemsize(itemsize)
    return out


def run_decode(
    stages: Sequence[Codec], stored: memoryview, geometry: KVGeometry, aad: bytes, out: memoryview | None
) -> memoryview | bytes:
    """Undo ``run_encode`` (the same stages); the last stage decodes into ``out`` where it can.

    Each stage's expected output size is known where every stage before it has a fixed size
    (lossy first), else bounded by the stage's ``max_encoded_bytes`` of what came before.
    """
    logical = geometry.page_bytes
    fixed: list[int | None] = [logical]  # the input size of each stage, where fixed
    bound = [logical]
    items = [geometry.dtype.itemsize]
    for stage in stages:
        prev = fixed[-1]
        fixed.append(stage.encoded_bytes(prev) if prev is not None else None)
        bound.append(stage.max_encoded_bytes(bound[-1]))
        items.append(stage.output_itemsize(items[-1]))
    data: memoryview | bytes = stored
    for i in range(len(stages) - 1, -1, -1):
        ctx = PageContext(geometry, aad, items[i], fixed[i], bound[i])
        data = stages[i].decode(memoryview(data), ctx, out if i == 0 else None)
        if fixed[i] is not None and len(data) != fixed[i]:
            raise CodecError("length")
    return data
