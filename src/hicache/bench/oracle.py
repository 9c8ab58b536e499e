"""The ``oracle`` configuration: the reference engine with a perfect prefix cache that costs nothing.

Every full page of KV the model computes is kept in memory (as the model's cache lays it out), and
each request starts from the longest page-aligned prefix of its prompt kept so far: what a cache
of unlimited capacity with free lookups, transfers and stores would give. Putting that prefix into
the model's cache, and keeping the new pages, happens while the engine's clock is stopped (and
while the ``ComputeGate`` is held, so nothing else runs meanwhile): no request's times include it.
Its TTFT is the limit a prefix cache can reach on the trace; the other configurations are reported
against it.

The kept pages live in one preallocated, pre-touched arena (``PageArena``), like the cache's own
pools: a page is a slot in it, not a fresh tensor. Keeping each page as its own allocation (the
heap growing by hundreds of 0.7 MiB chunks) doubled the oracle process's page faults on the
issue-12 trace (194k against 98k a run).

A model with recurrent layers continues only from their state at the prefix's end: the oracle keeps,
for every sequence, the KV and the state as they were after its last computed token, and a request
starts from the longest of those ends its prompt extends (exact, not rounded to a page or to a
checkpoint): the state and KV a recurrent cache could at best be given for free.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Callable
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio.to_thread
import numpy as np
import torch
import xxhash

from ..integrations.transformers import CachedCausalLM, ComputeGate
from ..integrations.transformers.causal_lm import Sequence, _check_tokens
from ..integrations.transformers.prefix_cache import KVBuffers, PrefixCache
from ..integrations.transformers.recurrent import State, restored_layer, snapshot

__all__ = ["OracleLM", "PageArena", "StoppableClock"]


class StoppableClock:
    """A clock (``base``: ``time.monotonic``, or ``time.process_time`` for CPU seconds) that does not
    advance while ``stopped()`` is in force."""

    def __init__(self, base: Callable[[], float] = time.monotonic) -> None:
        self._base = base
        self._lock = threading.Lock()
        self._excluded = 0.0
        self._since: float | None = None
        self.stopped_s = 0.0  # total time excluded, for the report

    def __call__(self) -> float:
        with self._lock:
            now = self._since if self._since is not None else self._base()
            return now - self._excluded

    @contextmanager
    def stopped(self) -> Any:
        with self._lock:
            assert self._since is None, "the clock is stopped already"
            self._since = self._base()
        try:
            yield
        finally:
            with self._lock:
                assert self._since is not None
                gap = self._base() - self._since
                self._excluded += gap
                self.stopped_s += gap
                self._since = None


class PageArena:
    """Pages ``[2, L, H, page, D]`` as slots of one tensor, allocated and touched up front; doubles
    when full (the oracle grows it with its clocks stopped)."""

    def __init__(self, page_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pages: int) -> None:
        self._data = torch.zeros((max(1, pages), *page_shape), dtype=dtype, device=device)
        self._slots: dict[bytes, int] = {}

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, key: bytes) -> torch.Tensor:
        return self._data[self._slots[key]]

    def keep(self, key: bytes, page: torch.Tensor) -> None:
        if key in self._slots:
            return
        slot = len(self._slots)
        if slot == self._data.shape[0]:
            grown = torch.zeros((2 * slot, *self._data.shape[1:]), dtype=self._data.dtype, device=self._data.device)
            grown[:slot].copy_(self._data)
            self._data = grown
        self._data[slot].copy_(page)
        self._slots[key] = slot

    @property
    def kept_bytes(self) -> int:
        return len(self._slots) * self._data[0].numel() * self._data.element_size()


class OracleLM:
    """A ``CachedCausalLM`` look-alike (no hicache) whose requests start from every page computed before.

    ``expected_tokens``: about how many tokens of KV the run computes, to size the page arena.
    """

    def __init__(self, model: Any, page_size: int, *, gate: ComputeGate | None = None,
                 expected_tokens: int = 0) -> None:
        self.inner = CachedCausalLM(model, None, gate=gate)
        self.gate = self.inner.gate
        self.vocab_size = self.inner.vocab_size
        self.page_size = page_size
        self.clock = StoppableClock(time.monotonic)  # the engine's clock
        self.cpu_clock = StoppableClock(time.process_time)  # and its cpu_clock
        spec = self.inner.spec
        self._pages = PageArena((2, spec.num_layers, spec.num_kv_heads, page_size, spec.head_dim), model.dtype,
                                self.inner.device, -(-expected_tokens // page_size))  # chain key -> page
        #: A recurrent model: each sequence's end (its tokens' digest) -> its KV ``[2, L, H, n, D]`` and state.
        self.recurrent = self.inner.recurrent
        self._ends: dict[bytes, tuple[torch.Tensor, dict[int, State]]] = {}
        self._end_lengths: set[int] = set()

    def page_keys(self, tokens: Seq[int], pages: int) -> list[bytes]:
        """Chained keys of the first ``pages`` full pages: key ``i`` names tokens ``[:(i+1) * page]``."""
        ps = self.page_size
        ids = np.asarray(tokens[: pages * ps], dtype=np.int64)
        keys: list[bytes] = []
        prev = b""
        for i in range(pages):
            prev = xxhash.xxh3_128_digest(prev + ids[i * ps : (i + 1) * ps].tobytes())
            keys.append(prev)
        return keys

    @contextmanager
    def clocks_stopped(self) -> Any:
        with self.clock.stopped(), self.cpu_clock.stopped():
            yield

    @property
    def kept_bytes(self) -> int:
        ends = sum(kv.numel() * kv.element_size() + sum(t.numel() * t.element_size() for st in states.values()
                   for t in st) for kv, states in self._ends.values())
        return self._pages.kept_bytes + ends

    @staticmethod
    def end_key(tokens: Seq[int]) -> bytes:
        return xxhash.xxh3_128_digest(np.asarray(tokens, dtype=np.int64).tobytes())

    def longest_end(self, prompt: list[int]) -> tuple[int, tuple[torch.Tensor, dict[int, State]] | None]:
        """The longest kept sequence end that ``prompt`` extends (a recurrent model's hit)."""
        for n in sorted(self._end_lengths, reverse=True):
            if n < len(prompt):
                kept = self._ends.get(self.end_key(prompt[:n]))
                if kept is not None:
                    return n, kept
        return 0, None

    async def lookup(self, tokens: Seq[int]) -> None:
        return None

    @asynccontextmanager
    async def sequence(self, tokens: Seq[int], *, store: bool = True, max_new_tokens: int = 64) -> AsyncIterator[Sequence]:
        prompt = _check_tokens(tokens, self.vocab_size)
        keys = self.page_keys(prompt, len(prompt) // self.page_size)
        pages = 0
        while pages < len(keys) and keys[pages] in self._pages:
            pages += 1
        buffers = self.inner.buffers.take(len(prompt) + max(0, max_new_tokens))
        try:
            seq = OracleSequence(self, prompt, buffers, keys[:pages])
            if self.recurrent:
                seq.cached_tokens, seq._end = self.longest_end(prompt)
            try:
                yield seq
                if store:
                    await seq.store()
            finally:
                seq.close()
        finally:
            self.inner.buffers.give_back(buffers)


class OracleSequence(Sequence):
    """A ``Sequence`` whose prefix comes from the oracle's pages, put in place with the clock stopped."""

    def __init__(self, oracle: OracleLM, prompt: list[int], buffers: KVBuffers, keys: list[bytes]) -> None:
        super().__init__(oracle.inner, prompt, None, buffers)
        self.oracle = oracle
        self._keys = keys
        self.cached_tokens = min(len(keys) * oracle.page_size, self.prompt_tokens - 1)
        self._kept = 0  # tokens whose pages the oracle holds from this sequence
        self._end: tuple[torch.Tensor, dict[int, State]] | None = None  # a recurrent model's prefix

    async def prefill(self) -> int:
        if self.cached_tokens > 0 and self._kv is None:
            async with self.lm.gate.hold(ComputeGate.PREFILL):
                with self.oracle.clocks_stopped():
                    self._kv = await anyio.to_thread.run_sync(self._prepare)
        return await super().prefill()

    def _prepare(self) -> Any:
        """The model's cache with the prefix already in its buffer (the engine's own memory)."""
        buffers = self._live()
        lm = self.lm
        if self._end is not None:
            kv, states = self._end
            n = self.cached_tokens
            buffers.data[:, :, 0, :, :n].copy_(kv)
            linear = {i: restored_layer(states[i], n, lm.spec.layers[i]) for i in lm.recurrent}
            return PrefixCache(lm.model.config, buffers, lm.spec.num_layers, restored=n, restore=_in_place,
                               segments=lm.segments, lazy=False, linear=linear)
        ps = self.oracle.page_size
        for i, key in enumerate(self._keys):
            buffers.data[:, :, 0, :, i * ps : (i + 1) * ps].copy_(self.oracle._pages[key])
        return PrefixCache(lm.model.config, buffers, lm.spec.num_layers, restored=self.cached_tokens,
                           restore=_in_place, segments=lm.segments, lazy=False)

    async def store(self) -> None:
        """Keep the full pages computed so far (clock stopped, gate held)."""
        if self._kv is None:
            return None
        if self.oracle.recurrent:
            async with self.lm.gate.hold(ComputeGate.DECODE):
                with self.oracle.clocks_stopped():
                    await anyio.to_thread.run_sync(self._keep_end)
            return None
        ps = self.oracle.page_size
        end = self._computed // ps * ps
        if end <= self._kept:
            return None
        async with self.lm.gate.hold(ComputeGate.DECODE):
            with self.oracle.clocks_stopped():
                await anyio.to_thread.run_sync(self._keep, end)
        return None

    def _keep_end(self) -> None:
        """A recurrent model: keep the KV and the state after every token computed."""
        n = self._computed
        key = self.oracle.end_key(self.tokens[:n])
        if key not in self.oracle._ends:
            kv = self._live().data[:, :, 0, :, :n].clone()
            self.oracle._ends[key] = (kv, snapshot(self._kv, self.lm.recurrent))
            self.oracle._end_lengths.add(n)

    def _keep(self, end: int) -> None:
        ps = self.oracle.page_size
        keys = self.oracle.page_keys(self.tokens, end // ps)
        buffers: KVBuffers = self._live()
        for i in range(self._kept // ps, end // ps):
            self.oracle._pages.keep(keys[i], buffers.data[:, :, 0, :, i * ps : (i + 1) * ps])
        self._kept = end


def _in_place(layer: int, kv: torch.Tensor) -> None:
    """The oracle's prefix is in the buffer already (put there with the clock stopped)."""
