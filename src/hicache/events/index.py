"""A router's index built from KV events, the way llm-d's precise prefix-cache scorer builds one.

Each event batch is applied for the instance it came from. ``BlockStored`` teaches the index a chain
(``parent_block_hash`` plus each block's ``token_ids``) and where each block is held; ``BlockRemoved``
forgets one medium; ``AllBlocksCleared`` forgets everything of that instance. A block announced in a
shared tier (medium ``SHARED``; or vLLM's ``STORAGE`` with locality ``REMOTE``, per ``ownership``) is
held by the tier, so it counts for every instance (all are taken to read the shared tiers), whichever
instance announced it, and outlives that instance's ``AllBlocksCleared``.

``hit(tokens, instance)`` walks the request's whole blocks from the start, as a router scores an
instance: the tokens of the longest prefix whose every block is held by that instance or by a shared
tier it reads. It needs no hash function of its own: blocks are matched by (parent, token ids).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from .base import REMOTE, SHARED, STORAGE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["PrefixIndex"]

_Where = tuple[str, str | None, str | None]  # (medium, locality, ownership)


class PrefixIndex:
    def __init__(self) -> None:
        self._chain: dict[tuple[int | None, tuple[int, ...]], int] = {}  # (parent, tokens) -> block hash
        self._held: dict[int, set[tuple[str, _Where]]] = defaultdict(set)  # block -> {(holder, where)}
        self._key: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # block hash -> its chain entry
        self.block_size: int | None = None
        self.events = 0

    @staticmethod
    def _holder(instance: str, where: _Where) -> str:
        medium, locality, ownership = where
        if medium == SHARED:
            return "shared:"
        if medium == STORAGE and locality == REMOTE:
            return "shared:" + (ownership or "")
        return instance

    def apply(self, instance: str, events: Iterable[KVEvent]) -> None:
        for e in events:
            self.events += 1
            if isinstance(e, BlockStored):
                where = (e.medium, e.locality, e.ownership)
                holder = self._holder(instance, where)
                bs = e.block_size
                self.block_size = bs
                parent = e.parent_block_hash
                for i, h in enumerate(e.block_hashes):
                    tokens = tuple(e.token_ids[i * bs : (i + 1) * bs])
                    self._chain[(parent, tokens)] = h
                    self._key[h] = (parent, tokens)
                    self._held[h].add((holder, where))
                    parent = h
            elif isinstance(e, BlockRemoved):
                where = (e.medium, e.locality, e.ownership)
                holder = self._holder(instance, where)
                for h in e.block_hashes:
                    held = self._held.get(h)
                    if held is not None:
                        held.discard((holder, where))
                        if not held:
                            self._forget(h)
            elif isinstance(e, AllBlocksCleared):
                for h in list(self._held):
                    held = self._held[h]
                    held -= {x for x in held if x[0] == instance}
                    if not held:
                        self._forget(h)

    def _forget(self, h: int) -> None:
        del self._held[h]
        key = self._key.pop(h, None)
        if key is not None and self._chain.get(key) == h:
            del self._chain[key]

    def hit(self, tokens: Sequence[int], instance: str, *, shared: bool = True) -> int:
        """Tokens of ``tokens``' longest prefix of whole blocks ``instance`` can serve (``shared``:
        counting shared tiers' blocks too)."""
        bs = self.block_size
        if not bs:
            return 0
        parent: int | None = None
        n = 0
        for start in range(0, len(tokens) - bs + 1, bs):
            h = self._chain.get((parent, tuple(tokens[start : start + bs])))
            held = self._held.get(h) if h is not None else None
            if not held or not any(holder == instance or (shared and holder.startswith("shared:"))
                                   for holder, _ in held):
                break
            n += bs
            parent = h
        return n

    def media(self, tokens: Sequence[int], instance: str) -> list[set[str]]:
        """The media holding each block of the prefix ``hit`` counts (for reports)."""
        bs = self.block_size or 0
        out: list[set[str]] = []
        parent: int | None = None
        for start in range(0, self.hit(tokens, instance), bs) if bs else ():
            h = self._chain[(parent, tuple(tokens[start : start + bs]))]
            out.append({where[0] for holder, where in self._held[h] if holder == instance or
                        holder.startswith("shared:")})
            parent = h
        return out
