"""``LruIndex``: the pages a backend knows of, least recently used first, for a byte ``capacity``.

A shared store (a folder, a server) cannot tell one client which of its pages to drop first, so a
backend with a ``capacity`` keeps the keys it wrote or read, and evicts from them. Several
processes sharing one store each enforce their own capacity on the pages they know of.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["LruIndex"]


class LruIndex:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def remember(self, key: bytes, size: int) -> None:
        """``key`` is stored with ``size`` bytes and was just used."""
        self.forget(key)
        self._sizes[key] = size
        self.used += size

    def forget(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used -= size

    def clear(self) -> None:
        self._sizes.clear()
        self.used = 0

    def plan(self, keys: Sequence[bytes], sizes: Sequence[int]) -> tuple[int, list[bytes]]:
        """How many of ``keys`` (from the first) fit, and the keys to evict to make room for them.

        A write never evicts its own earlier pages and never exceeds the capacity: the pages after
        the first that does not fit are not written (keys are chained, so they would be useless).
        """
        if self.capacity is None:
            return len(keys), []
        fits, room = 0, self.capacity
        while fits < len(keys) and sizes[fits] <= room:
            room -= sizes[fits]
            fits += 1
        incoming = dict(zip(keys[:fits], sizes[:fits], strict=True))
        excess = self.used + sum(incoming.values()) - sum(self._sizes.get(k, 0) for k in incoming) - self.capacity
        victims = []
        for key, size in self._sizes.items():  # least recently used first
            if excess <= 0:
                break
            if key not in incoming:
                victims.append(key)
                excess -= size
        return fits, victims
