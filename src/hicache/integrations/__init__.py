"""Integrations of hicache into inference stacks.

``hicache.integrations.transformers`` wraps a Hugging Face causal LM: the worked example of how
an engine asks hicache for a cached prefix, restores it layer by layer, computes the rest and
stores the new pages.
"""
