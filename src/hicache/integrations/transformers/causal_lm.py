"""``CachedCausalLM``: a Hugging Face causal LM whose prefill starts from hicache's longest prefix.

The flow an engine follows (and what ``hicache.engine`` does):

1. ``lookup(prompt)`` when a request is queued: cheap, and starts the storage prefetch early.
2. ``sequence(prompt)`` when it is scheduled: leases the cached prefix on the device tier.
3. ``prefill()``: restores the prefix into the model's cache layer by layer while the forward runs
   over the uncached rest, and returns the first greedy token.
4. ``store()`` / leaving the block: the new full pages go into hicache for the next request.

Model compute runs in worker threads, one step at a time through a ``ComputeGate`` (prefills
first), so the event loop keeps serving the cache (prefetch, backup, load-back) meanwhile.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import asynccontextmanager
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.to_thread
import torch

from ...errors import InvalidRequestError, InvalidTokensError
from .gate import ComputeGate
from .restoring_cache import RestoringCache, layer_tensors
from .spec import ModelSpec

if TYPE_CHECKING:
    from ...cache import HiCache, Hit, StoreResult
    from ...leases import RetrieveView

__all__ = ["CachedCausalLM", "Sequence"]


class CachedCausalLM:
    """Wraps ``model`` (a transformers causal LM) so its prefill reuses KV from ``cache``.

    ``cache=None`` gives the same API without caching (the no-cache baseline). ``layerwise=False``
    restores every layer before the forward instead of as the forward reaches it.
    """

    def __init__(
        self,
        model: Any,
        cache: HiCache | None,
        *,
        gate: ComputeGate | None = None,
        layerwise: bool = True,
    ) -> None:
        self.model = model.eval()
        self.cache = cache
        self.spec = ModelSpec.of(model)
        if cache is not None:
            self.spec.check(cache.config)
        self.gate = gate if gate is not None else ComputeGate()
        self.layerwise = layerwise
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # 5.x / 4.5x
        self._logits_kw = "logits_to_keep" if "logits_to_keep" in params else None
        self.device = next(model.parameters()).device
        cfg = model.config
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        self.vocab_size: int | None = getattr(text, "vocab_size", None)

    async def lookup(self, tokens: Seq[int]) -> Hit | None:
        """Ask the cache how much of ``tokens`` it holds; starts a prefetch from storage if worth it."""
        return None if self.cache is None else await self.cache.lookup(tokens)

    @asynccontextmanager
    async def sequence(self, tokens: Seq[int], *, store: bool = True) -> AsyncIterator[Sequence]:
        """A generation over ``tokens``; the cached prefix stays leased until the block exits.

        On a normal exit, with ``store=True``, the new full pages of every token whose KV was
        computed are stored. An error or cancellation skips that (the lease is released either way).
        """
        prompt = _check_tokens(tokens, self.vocab_size)
        if self.cache is None:
            yield Sequence(self, prompt, None)
            return
        async with self.cache.retrieve(prompt) as view:
            seq = Sequence(self, prompt, view)
            yield seq
            if store:
                await seq.store()

    # -- compute (worker threads) ----------------------------------------------------------------

    def forward(self, ids: list[int], kv: Any) -> torch.Tensor:
        """Run ``ids`` through the model on top of ``kv``; the last position's logits."""
        kwargs: dict[str, Any] = {self._cache_kw: kv, "use_cache": True}
        if self._logits_kw is not None:
            kwargs[self._logits_kw] = 1
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids], device=self.device), **kwargs)
        return out.logits[0, -1].float()


class Sequence:
    """One request's tokens and model cache; made by ``CachedCausalLM.sequence``.

    ``tokens`` grows as ``decode`` is called; ``cached_tokens`` and ``by_tier`` say how much of the
    prompt was restored and from which tier; ``logits`` are the last step's.
    """

    def __init__(self, lm: CachedCausalLM, prompt: list[int], view: RetrieveView | None) -> None:
        self.lm = lm
        self.tokens = prompt
        self.prompt_tokens = len(prompt)
        self._view = view
        # At least one prompt token is computed, to have logits: a fully cached prompt recomputes its last.
        self.cached_tokens = min(view.tokens, len(prompt) - 1) if view is not None else 0
        self.by_tier: Mapping[str, int] = MappingProxyType(dict(view.by_tier) if view is not None else {})
        self.logits: torch.Tensor | None = None
        self._kv: Any = None
        self._computed = 0  # tokens whose KV is in self._kv
        self._stored = view.tokens if view is not None else 0  # tokens (whole pages) the cache has from us

    async def prefill(self) -> int:
        """Restore the cached prefix, compute the rest of the prompt; return the first greedy token."""
        if self._kv is not None:
            raise InvalidRequestError("prefill() was called already for this sequence")
        async with self.lm.gate.hold(ComputeGate.PREFILL):
            logits = await anyio.to_thread.run_sync(self._prefill)
        self.logits = logits
        return int(logits.argmax())

    async def decode(self, token: int) -> int:
        """Append ``token``, run one step; return the next greedy token."""
        if self._kv is None:
            raise InvalidRequestError("decode() needs prefill() first")
        (token,) = _check_tokens([token], self.lm.vocab_size)
        self.tokens.append(token)
        async with self.lm.gate.hold(ComputeGate.DECODE):
            logits = await anyio.to_thread.run_sync(self._step, int(token))
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
        async with self.lm.gate.hold(ComputeGate.DECODE):
            kv = await anyio.to_thread.run_sync(self._export, start, end)
        self._stored = end
        return await cache.store(self.tokens[:end], kv, start=start)

    # -- worker-thread parts ----------------------------------------------------------------------

    def _prefill(self) -> torch.Tensor:
        n = self.cached_tokens
        fetch = self._fetch_layer if n > 0 else None
        lm = self.lm
        kv = RestoringCache(lm.model.config, fetch, lm.spec.num_layers, lazy=lm.layerwise)
        logits = lm.forward(self.tokens[n:], kv)
        self._kv = kv
        self._computed = len(self.tokens)
        return logits

    def _fetch_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        view = self._view
        assert view is not None
        if not view.is_layer_ready(layer):
            anyio.from_thread.run(view.wait_layer, layer)  # the load-back is still bringing it
        k, v = view.layer(layer)  # [T, H, D] each
        n = self.cached_tokens
        device = self.lm.device
        return k[:n].to(device).permute(1, 0, 2).unsqueeze(0), v[:n].to(device).permute(1, 0, 2).unsqueeze(0)

    def _step(self, token: int) -> torch.Tensor:
        logits = self.lm.forward([token], self._kv)
        self._computed += 1
        return logits

    def _export(self, start: int, end: int) -> torch.Tensor:
        """KV of tokens ``start..end`` as ``[2, L, end - start, H, D]`` for ``HiCache.store``."""
        spec = self.lm.spec
        cache = self.lm.cache
        assert cache is not None
        out = torch.empty(
            (2, spec.num_layers, end - start, spec.num_kv_heads, spec.head_dim),
            dtype=cache.config.model.torch_dtype,
            device=cache.device_kv.device,
        )
        for layer in range(spec.num_layers):
            k, v = layer_tensors(self._kv, layer)
            out[0, layer].copy_(k[0, :, start:end].transpose(0, 1))
            out[1, layer].copy_(v[0, :, start:end].transpose(0, 1))
        return out


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
