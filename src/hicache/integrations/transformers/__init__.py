"""Hugging Face transformers: a causal LM whose prefill reuses hicache's KV.

    model = AutoModelForCausalLM.from_pretrained(...)
    config = hicache.load_config("config/engine.yaml", overrides=model_overrides(model))
    async with hicache.HiCache.from_config(config) as cache:
        lm = CachedCausalLM(model, cache)
        await lm.lookup(prompt)                     # when the request is queued: starts a prefetch
        async with lm.sequence(prompt) as seq:      # leases the cached prefix
            token = await seq.prefill()             # restores it, computes the rest; first greedy token
            await seq.store()                       # share the prompt's pages now (optional)
            token = await seq.decode(token)         # one greedy step
        # leaving the block stores the new full pages (prompt and generated)

Works with transformers 5.x (``cache=``) and 4.5x (``past_key_values=``). The model's geometry
comes from its config (``model_overrides``), so YAML does not repeat it.
"""

from .causal_lm import CachedCausalLM, Sequence
from .gate import ComputeGate
from .prefix_cache import PrefixCache
from .spec import ModelSpec, model_fingerprint, model_overrides

__all__ = ["CachedCausalLM", "Sequence", "ComputeGate", "PrefixCache", "ModelSpec", "model_fingerprint", "model_overrides"]
