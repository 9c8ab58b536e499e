"""``CachedCausalLM``: a Hugging Face causal LM whose prefill starts from hicache's longest prefix.

The flow an engine follows (and what ``hicache.engine`` does):

1. ``lookup(prompt)`` when a request is queued: cheap, and starts the storage prefetch early.
2. ``sequence(prompt)`` when it is scheduled: leases the cached prefix on the device tier.
3. ``prefill()``: restores the prefix into the model's cache layer by layer while the forward runs
   over the uncached rest, and returns the first greedy token.
4. ``store()`` / leaving the block: the new full pages go into hicache for the next request.

Model compute runs in worker threads, one step at a time through a ``ComputeGate`` (prefills
first), so the event loop keeps serving the cache (prefetch, backup, load-back) meanwhile. The
model's cache is a ``PrefixCache``: buffers preallocated for the prompt and the expected output
(reused between sequences), into which the prefix is copied once, straight from the cache's
device pages, and each step writes its new tokens in place.

Each ``Sequence`` times its stages (``Sequence.stages``, seconds), for benchmarks and profiles.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager, nullcontext
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from ...errors import InvalidRequestError, InvalidTokensError, UnsupportedModelError
from .attention import available as segments_available
from .attention import using_segments
from .gate import ComputeGate
from .prefix_cache import BufferPool, KVBuffers, PrefixCache, layer_tensors
from .recurrent import RecordingLayer, State, conv_only, pack, record_delta_rules, restored_layer, snapshot, unpack
from .spec import ModelSpec, cache_keyword

if TYPE_CHECKING:
    from ...cache import HiCache, Hit, StoreResult
    from ...leases import RetrieveView

__all__ = ["CachedCausalLM", "Sequence"]


class CachedCausalLM:
    """Wraps ``model`` (a transformers causal LM) so its prefill reuses KV from ``cache``.

    ``cache=None`` gives the same API without caching (the no-cache baseline). ``layerwise=False``
    restores every layer before the forward instead of as the forward reaches it.
    ``yield_to_prefills`` (default) makes the cache's backups and storage writes wait while a
    prefill computes (at most ``controller.yield_max_s`` at a time), so they do not compete with it
    for the cores. ``segment_attention`` (default: where it runs, the CPU, for models without
    sliding-window layers, which it cannot mask) attends with ``attention.py``'s calls (torch's
    causal flash kernel for the step's own tokens, the prefix unmasked, no ``repeat_kv`` copies; a
    cold prefill makes exactly the model's own call); ``False`` keeps the model's own attention.
    The restored prefix is copied into the model's cache, page run by page run, as the forward
    reaches each layer; ``attend_in_pages=True`` (segment attention only) attends over it where it
    lies in the device pages instead. That saves the copy but costs more than it saves on the CPU:
    a flash call and a merge per run of pages, in every layer of the prefill and of every decode
    step (``benchmarks/prefix_attention.py``).

    A model with recurrent layers (``layer_kinds``) continues only from a checkpoint of their
    state: the prefill runs in chunks that end where one is due (every
    ``policies.checkpoint_interval_tokens``, where the prompt's last page ends, and one page
    before), copies the state there, and ``store`` hands those checkpoints to the cache; a decode
    step that ends a page copies it too. Such a sequence asks the cache for its prompt less the
    last token, so the hit it gets is one it can continue from and still compute that token.
    """

    def __init__(
        self,
        model: Any,
        cache: HiCache | None,
        *,
        gate: ComputeGate | None = None,
        layerwise: bool = True,
        yield_to_prefills: bool = True,
        segment_attention: bool | None = None,
        attend_in_pages: bool = False,
    ) -> None:
        self.model = model.eval()
        self.cache = cache
        self.spec = ModelSpec.of(model)
        if cache is not None:
            self.spec.check(cache.config)
        self.gate = gate if gate is not None else ComputeGate()
        if cache is not None and yield_to_prefills:
            # The cache's backups and storage writes wait while a prefill computes (bounded).
            cache.controller.yield_to_compute = self.gate.wait_no_prefill
        self.layerwise = layerwise
        params = inspect.signature(model.forward).parameters
        self._cache_kw = cache_keyword(model)  # 5.x / 4.5x
        self._logits_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.device = next(model.parameters()).device
        available = segments_available(self.device)
        if segment_attention and not available:
            raise UnsupportedModelError(f"segment attention runs on the CPU only (the model is on {self.device})")
        if segment_attention and self.spec.layers.hybrid:
            raise UnsupportedModelError("segment attention has no sliding window: use the model's own attention")
        if segment_attention is None:
            segment_attention = available and not self.spec.layers.hybrid
        self.segments = segment_attention
        if attend_in_pages and not self.segments:
            raise UnsupportedModelError("attend_in_pages needs segment attention (the CPU)")
        self.attend_in_pages = attend_in_pages
        cfg = model.config
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size: int | None = getattr(text, "vocab_size", None)
        spec = self.spec
        self.buffers = BufferPool(spec.num_layers, spec.num_kv_heads, spec.head_dim, model.dtype, self.device)
        #: Recurrent layers (model layer indices), and where each model layer lies in a page.
        self.recurrent = spec.layers.recurrent
        #: Recurrent layers that are gated delta nets whose chunked rule records (Qwen3-Next).
        self.delta_rules = record_delta_rules(model) & frozenset(self.recurrent) if self.recurrent else frozenset()
        #: Every recurrent layer a convolution (LFM2) or a gated delta net: a prefill's checkpoints
        #: come from one forward; other SSMs (Mamba) cut the forward at each one.
        self.one_forward = bool(self.recurrent) and all(
            conv_only(spec.layers[i]) or i in self.delta_rules for i in self.recurrent
        )
        self.slots = spec.layers.slots(cache.config.slot_bytes) if cache is not None else ()
        self.num_cache_layers = cache.config.num_cache_layers if cache is not None else spec.num_layers
        every = cache.config.policies.checkpoint_interval_tokens if cache is not None else 0
        self.checkpoint_every = every // cache.page_size * cache.page_size if cache is not None else 0

    def page_layer(self, layer: int) -> int:
        """The cache layer that holds model layer ``layer``'s KV (the same index unless some are recurrent)."""
        return self.slots[layer][0] if self.slots else layer

    def _asked(self, tokens: Seq[int]) -> Seq[int]:
        """What to look up for a prompt: a recurrent model's, less its last token (see the class)."""
        return tokens[:-1] if self.recurrent else tokens

    async def lookup(self, tokens: Seq[int]) -> Hit | None:
        """Ask the cache how much of ``tokens`` it holds; starts a prefetch from storage if worth it."""
        return None if self.cache is None else await self.cache.lookup(self._asked(list(tokens)))

    @asynccontextmanager
    async def sequence(
        self, tokens: Seq[int], *, store: bool = True, max_new_tokens: int = 64
    ) -> AsyncIterator[Sequence]:
        """A generation over ``tokens``; the cached prefix stays leased until the block exits.

        On a normal exit, with ``store=True``, the new full pages of every token whose KV was
        computed are stored. An error or cancellation skips that (the lease is released either way).
        ``max_new_tokens`` sizes the model's cache (it grows if the sequence goes beyond).
        """
        prompt = _check_tokens(tokens, self.vocab_size)
        buffers = self.buffers.take(len(prompt) + max(0, max_new_tokens))
        try:
            if self.cache is None:
                seq = Sequence(self, prompt, None, buffers)
                try:
                    yield seq
                finally:
                    seq.close()
                return
            started = time.perf_counter()
            async with self.cache.retrieve(self._asked(prompt)) as view:
                seq = Sequence(self, prompt, view, buffers)
                seq.stages["retrieve"] = time.perf_counter() - started
                try:
                    yield seq
                    if store:
                        await seq.store()
                finally:
                    seq.close()
        finally:
            self.buffers.give_back(buffers)

    # -- compute (worker threads) ----------------------------------------------------------------

    def forward(self, ids: list[int], kv: Any) -> torch.Tensor:
        """Run ``ids`` through the model on top of ``kv``; the last position's logits."""
        kwargs: dict[str, Any] = {self._cache_kw: kv, "use_cache": True}
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        with torch.inference_mode(), (using_segments(self.model) if self.segments else nullcontext()):
            out = self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)
        return out.logits[0, -1].float()


class Sequence:
    """One request's tokens and model cache; made by ``CachedCausalLM.sequence``.

    ``tokens`` grows as ``decode`` is called; ``cached_tokens`` and ``by_tier`` say how much of the
    prompt was restored and from which tier; ``logits`` are the last step's. ``stages`` holds the
    seconds spent in each stage so far (``STAGES``); ``restore_wait_by_layer`` the seconds the
    forward waited for each layer's load-back.
    """

    #: the stages ``stages`` times, in the order a request meets them
    STAGES = (
        "retrieve",  # entering cache.retrieve: prefetch wait, device pages, queueing the load-back
        "prefill_gate",  # waiting for the ComputeGate before the prefill
        "prefill_hop",  # thread hops: to the worker thread and back
        "restore_wait",  # the forward waiting for load-back layers (all layers)
        "restore_copy",  # copying the prefix from device pages into the model's cache
        "prefill_compute",  # the forward itself
        "store_gate", "export", "store",  # copying new pages out of the model, then cache.store
        "decode_gate", "decode_hop", "decode_compute",
    )

    def __init__(self, lm: CachedCausalLM, prompt: list[int], view: RetrieveView | None, buffers: KVBuffers) -> None:
        self.lm = lm
        self.tokens = prompt
        self.prompt_tokens = len(prompt)
        self._view = view
        self._buffers: KVBuffers | None = buffers
        # At least one prompt token is computed, to have logits: a fully cached prompt recomputes its last.
        self.cached_tokens = min(view.tokens, len(prompt) - 1) if view is not None else 0
        self.by_tier: Mapping[str, int] = MappingProxyType(dict(view.by_tier) if view is not None else {})
        self.logits: torch.Tensor | None = None
        self.stages: dict[str, float] = dict.fromkeys(self.STAGES, 0.0)
        self.restore_wait_by_layer: list[float] = [0.0] * lm.num_cache_layers
        self._snapshots: dict[int, dict[int, State]] = {}  # checkpoints not stored yet, by token count
        self._record: list[int] = []  # the checkpoints a conv-only model's prefill reads off its forward
        self._kv: Any = None
        self._computed = 0  # tokens whose KV is in self._kv
        self._stored = view.tokens if view is not None else 0  # tokens (whole pages) the cache has from us
        self._pool: torch.Tensor | None = None
        self._runs: list[tuple[int, int, int]] = []  # (first token, first device page, pages) of the prefix
        if view is not None and self.cached_tokens > 0:
            assert lm.cache is not None
            self._pool = lm.cache.device_kv
            self._runs = _runs(view.device_pages, lm.cache.page_size, self.cached_tokens)

    def close(self) -> None:
        """The model cache's buffers go back to the pool: the sequence cannot step any more."""
        self._buffers = None
        self._kv = None

    async def prefill(self) -> int:
        """Restore the cached prefix, compute the rest of the prompt; return the first greedy token."""
        if self._computed:
            raise InvalidRequestError("prefill() was called already for this sequence")
        self._live()
        logits = await self._compute(ComputeGate.PREFILL, "prefill", self._prefill)
        self.logits = logits
        return int(logits.argmax())

    async def decode(self, token: int) -> int:
        """Append ``token``, run one step; return the next greedy token."""
        if self._kv is None:
            raise InvalidRequestError("decode() needs prefill() first")
        (token,) = _check_tokens([token], self.lm.vocab_size)
        self.tokens.append(token)
        logits = await self._compute(ComputeGate.DECODE, "decode", self._step, int(token))
        self.logits = logits
        return int(logits.argmax())

    async def store(self) -> StoreResult | None:
        """Store the full pages computed since the last store (nothing without a cache)."""
        cache = self.lm.cache
        if cache is None or self._kv is None:
            return None
        end = self._computed // cache.page_size * cache.page_size
        if end <= self._stored:
            return None
        start = self._stored
        kv = await self._compute(ComputeGate.DECODE, "store", self._export, start, end)
        self._stored = end
        checkpoints = sorted(c for c in self._snapshots if start < c <= end) if self.lm.recurrent else None
        for c in [c for c in self._snapshots if c <= end]:
            del self._snapshots[c]
        started = time.perf_counter()
        try:
            return await cache.store(self.tokens[:end], kv, start=start, checkpoints=checkpoints)
        finally:
            self.stages["store"] += time.perf_counter() - started

    async def _compute(self, priority: int, stage: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in a worker thread while holding the gate, timed as ``stage``'s parts."""
        stages = self.stages
        asked = time.perf_counter()
        async with self.lm.gate.hold(priority):
            held = time.perf_counter()
            stages[f"{stage}_gate"] += held - asked
            out, began, ended = await anyio.to_thread.run_sync(_timed, fn, args)
            back = time.perf_counter()
        hop = (began - held) + (back - ended)
        if stage == "store":
            stages["export"] += ended - began + hop
        else:
            stages[f"{stage}_hop"] += hop
            stages[f"{stage}_compute"] += ended - began
        return out

    def _live(self) -> KVBuffers:
        if self._buffers is None:
            raise InvalidRequestError("this sequence's block has exited")
        return self._buffers

    # -- worker-thread parts ----------------------------------------------------------------------

    def _model_cache(self, lazy: bool) -> PrefixCache:
        """The model's cache for this prompt; the prefix is put in place as the forward reaches each
        layer (``lazy``) or now: copied in, or as views of the device pages (``attend_in_pages``)."""
        n = self.cached_tokens
        lm = self.lm
        kwargs: dict[str, Any] = {}
        if n > 0:
            kwargs = {"prefix": self._prefix_views} if lm.attend_in_pages else {"restore": self._restore_layer}
        if lm.recurrent:
            kwargs["linear"] = self._recurrent_layers(n)
            if n > 0:
                kwargs["fill_linear"] = self._fill_recurrent
        return PrefixCache(lm.model.config, self._live(), lm.spec.num_layers, restored=n, segments=lm.segments,
                           lazy=lazy, **kwargs)

    def _recurrent_layers(self, n: int) -> dict[int, Any]:
        """The recurrent layers' cache layers: fresh, or (``n`` > 0) to continue from the checkpoint
        after the prefix's ``n`` tokens, which ``_fill_recurrent`` puts in when the forward reaches
        the layer; their token count is set now (``get_seq_length`` may read any layer)."""
        from transformers.cache_utils import LinearAttentionLayer

        lm = self.lm
        out = {}
        for i in lm.recurrent:
            layer = RecordingLayer(self._record, delta_rule=i in lm.delta_rules) if lm.one_forward else (
                LinearAttentionLayer()
            )
            if n > 0:
                layer.cumulative_length_linear = torch.tensor(n, dtype=torch.long)
            out[i] = layer
        return out

    def _fill_recurrent(self, i: int, layer: Any) -> None:
        """Recurrent layer ``i`` continues from the checkpoint on the hit's last page (its ``state``
        cache layers, waited for here)."""
        lm = self.lm
        n = self.cached_tokens
        pool = self._pool
        assert pool is not None and self._view is not None
        page = self._view.device_pages[n // lm.cache.page_size - 1]  # type: ignore[union-attr]
        first, count = lm.slots[i]
        for j in range(first, first + count):
            self._wait_layer(j)
        started = time.perf_counter()
        state = unpack(lm.spec.layers[i], pool[:, first : first + count, page])
        restored_layer(state, n, lm.spec.layers[i], layer)
        self.stages["restore_copy"] += time.perf_counter() - started

    def _checkpoint_ends(self, start: int, end: int) -> list[int]:
        """Where a prefill of tokens ``start..end`` stops to copy a checkpoint: interval multiples,
        the prompt's last page end and the one before it (a repeat of this prompt continues there)."""
        lm = self.lm
        if not lm.recurrent or lm.cache is None:
            return []
        ps = lm.cache.page_size
        ends = {end // ps * ps, (end - 1) // ps * ps}
        if lm.checkpoint_every:
            ends |= set(range(lm.checkpoint_every, end + 1, lm.checkpoint_every))
        return sorted(e for e in ends if start < e <= end)

    def _prefill(self) -> torch.Tensor:
        n = self.cached_tokens
        lm = self.lm
        end = len(self.tokens)
        ends = self._checkpoint_ends(n, end)
        self._record = ends if lm.one_forward else []
        kv = self._kv if self._kv is not None else self._model_cache(lm.layerwise)
        at = n
        logits = None
        for stop in ends if not lm.one_forward else ():
            logits = lm.forward(self.tokens[at:stop], kv)  # a Mamba layer's state: the forward stops there
            self._snapshots[stop] = snapshot(kv, lm.recurrent)
            at = stop
        if at < end:
            logits = lm.forward(self.tokens[at:], kv)
        if lm.one_forward:
            for stop in ends:
                self._snapshots[stop] = {i: kv.layers[i].take(stop) for i in lm.recurrent}
            for i in lm.recurrent:
                kv.layers[i].record = []
        assert logits is not None
        self._kv = kv
        self._computed = end
        # The forward's own time excludes what restoring took (timed separately).
        self.stages["prefill_compute"] -= self.stages["restore_wait"] + self.stages["restore_copy"]
        return logits

    def _wait_layer(self, layer: int) -> None:
        """Block until the load-back has brought cache layer ``layer`` of the prefix (timed)."""
        view = self._view
        assert view is not None
        if not view.is_layer_ready(layer):
            started = time.perf_counter()
            anyio.from_thread.run(view.wait_layer, layer)  # the load-back is still bringing it
            waited = time.perf_counter() - started
            self.restore_wait_by_layer[layer] += waited
            self.stages["restore_wait"] += waited

    def _prefix_views(self, layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer ``layer`` of the prefix as views ``[1, H, n, D]`` of the device pages, one per run."""
        layer = self.lm.page_layer(layer)
        self._wait_layer(layer)
        pool = self._pool
        assert pool is not None
        _, _, _, page_size, heads, dim = pool.shape
        out = []
        for first, page, pages in self._runs:
            take = min(pages * page_size, self.cached_tokens - first)
            k, v = (pool[c, layer, page : page + pages].view(pages * page_size, heads, dim)[:take] for c in (0, 1))
            out.append((k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)))
        return out

    def _restore_layer(self, layer: int, kv: torch.Tensor) -> None:
        """Copy layer ``layer`` of the prefix from the device pages into the model's cache
        (``kv``: ``[2, 1, H, capacity, D]``), keys and values of a run of pages in one copy."""
        layer = self.lm.page_layer(layer)
        self._wait_layer(layer)
        pool = self._pool
        assert pool is not None
        started = time.perf_counter()
        _, _, _, page_size, heads, dim = pool.shape
        for first, page, pages in self._runs:
            take = min(pages * page_size, self.cached_tokens - first)
            src = pool[:, layer, page : page + pages].view(2, pages * page_size, heads, dim)[:, :take]
            kv[:, 0, :, first : first + take].copy_(src.transpose(1, 2))
        self.stages["restore_copy"] += time.perf_counter() - started

    def _step(self, token: int) -> torch.Tensor:
        self._live()
        lm = self.lm
        logits = lm.forward([token], self._kv)
        self._computed += 1
        if lm.recurrent and lm.cache is not None and self._computed % lm.cache.page_size == 0:
            # A page ended: its checkpoint, for the next store. The previous page's goes unless
            # an interval wants it (at most one such copy waits beside the interval ones).
            last = self._computed - lm.cache.page_size
            if last in self._snapshots and last > self._stored and not (
                lm.checkpoint_every and last % lm.checkpoint_every == 0
            ):
                del self._snapshots[last]
            self._snapshots[self._computed] = snapshot(self._kv, lm.recurrent)
        return logits

    def _export(self, start: int, end: int) -> torch.Tensor:
        """KV of tokens ``start..end`` as ``[2, L, end - start, H, D]`` for ``HiCache.store`` (``L``:
        cache layers); a recurrent layer's checkpoints go in the ``state`` layers of the pages they
        end, and are zero elsewhere."""
        lm = self.lm
        spec = lm.spec
        cache = lm.cache
        assert cache is not None
        new = torch.zeros if lm.recurrent else torch.empty
        out = new(
            (2, lm.num_cache_layers, end - start, spec.num_kv_heads, spec.head_dim),
            dtype=cache.config.model.torch_dtype,
            device=cache.device_kv.device,
        )
        recurrent = set(lm.recurrent)
        for layer in range(spec.num_layers):
            if layer in recurrent:
                continue
            k, v = layer_tensors(self._kv, layer)
            at = lm.page_layer(layer)
            out[0, at].copy_(k[0, :, start:end].transpose(0, 1))
            out[1, at].copy_(v[0, :, start:end].transpose(0, 1))
        ps = cache.page_size
        for c, states in self._snapshots.items():
            if start < c <= end:
                for i, state in states.items():
                    first, count = lm.slots[i]
                    pack(state, out[:, first : first + count, c - ps - start : c - start])
        return out


def _timed(fn: Any, args: tuple[Any, ...]) -> tuple[Any, float, float]:
    began = time.perf_counter()
    out = fn(*args)
    return out, began, time.perf_counter()


def _runs(pages: list[int], page_size: int, tokens: int) -> list[tuple[int, int, int]]:
    """The first ``tokens`` tokens' device pages as runs ``(first token, first page, pages)``."""
    needed = pages[: -(-tokens // page_size)]
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(needed):
        j = i + 1
        while j < len(needed) and needed[j] == needed[j - 1] + 1:
            j += 1
        runs.append((i * page_size, needed[i], j - i))
        i = j
    return runs


def _check_tokens(tokens: Any, vocab_size: int | None) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    try:
        out = [int(t) for t in tokens]
    except (TypeError, ValueError) as exc:
        raise InvalidTokensError(f"tokens must be a sequence of ints: {exc}") from exc
    if not out:
        raise InvalidTokensError("a sequence needs at least one prompt token")
    if min(out) < 0:
        raise InvalidTokensError("token ids must be non-negative")
    if vocab_size is not None and max(out) >= vocab_size:
        raise InvalidTokensError(f"token id {max(out)} is outside the model's vocabulary of {vocab_size}")
    return out
