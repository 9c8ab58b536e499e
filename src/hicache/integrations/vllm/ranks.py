"""The scheduler's view of a tensor-parallel engine: one worker a rank, each with its own cache.

Under tensor parallelism every TP rank of a vLLM engine is a worker process of its own, and its
connector opens a ``HiCache`` of its own holding that rank's KV heads (``settings.parallel_section``:
each rank's pages are in its own namespace), listening on a channel of its own
(``socket_path(engine_id, rank)``). vLLM's scheduler asks one connector; ``RankChannels`` asks
every rank and makes the answers agree:

* ``lookup``: the minimum over the ranks, so a prefix counts only where every rank holds it. A rank
  that cannot answer holds nothing. With ``prefetch``, every rank starts its own prefetch.
* ``forget``: told to every rank (each holds its own prefetches and hand-off receives).
* A lookup that carries a producer's hand-off (``expect``) is accepted only where every rank
  accepts it (each compares its own check); a ``handoff`` answers the fewest tokens any rank
  holds and every rank's check, in rank order, and the pulse period where every rank pulses at
  the same (``agree_handoffs``).
* A load that fails on one rank: that worker reports the blocks it could not fill, vLLM takes the
  union over its workers (``KVOutputAggregator``) and recomputes those blocks on every rank. A save
  that fails on one rank leaves that rank without the pages: the next lookup's minimum does not
  count them, so they are recomputed on all ranks again.

A single-rank engine has one channel, named as it always was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .channel import ChannelClient, socket_path

__all__ = ["RankChannels", "agree_handoffs", "agree_lookups"]


def agree_lookups(replies: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One lookup answer from every rank's: the fewest tokens any rank holds (none where one failed)."""
    tokens = [0 if r is None else int(r.get("tokens", 0)) for r in replies]
    out: dict[str, Any] = {"tokens": min(tokens, default=0), "ranks": tokens}
    if any(r is not None and "expect" in r for r in replies):
        out["expect"] = all(r is not None and bool(r.get("expect")) for r in replies)
    return out


def agree_handoffs(replies: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """One hand-off answer: the fewest tokens any rank holds (none where one failed), each rank's check."""
    tokens = [0 if r is None else int(r.get("tokens", 0)) for r in replies]
    out = {"tokens": min(tokens, default=0), "checks": [None if r is None else r.get("check") for r in replies]}
    pulses = {None if r is None else r.get("pulse_s") for r in replies}
    if len(pulses) == 1 and None not in pulses:  # every rank pulses, at one period
        out["pulse_s"] = pulses.pop()
    return out


class RankChannels:
    """The scheduler's channels to the workers of ranks ``0..num_ranks-1``; ``call`` as ``ChannelClient``."""

    def __init__(self, engine_id: str, num_ranks: int, **client_options: Any) -> None:
        if num_ranks < 1:
            raise ValueError(f"an engine has at least one rank, got {num_ranks}")
        self.clients = [ChannelClient(socket_path(engine_id, rank), **client_options) for rank in range(num_ranks)]

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.clients)

    def call(self, message: dict[str, Any]) -> dict[str, Any] | None:
        """Ask every rank. A lookup answers the agreed prefix (``agree_lookups``); any other message
        answers rank 0's reply, or ``None`` when any rank failed to answer."""
        if len(self.clients) == 1:
            return self.clients[0].call(message)
        replies = [client.call(message) for client in self.clients]
        if message.get("op") == "lookup":
            return agree_lookups(replies)
        if message.get("op") == "handoff":
            return agree_handoffs(replies)
        return None if any(r is None for r in replies) else replies[0]

    def close(self) -> None:
        for client in self.clients:
            client.close()
