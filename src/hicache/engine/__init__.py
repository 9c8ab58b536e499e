"""A reference engine: an asyncio request loop that serves a ``CachedCausalLM`` through hicache.

It is small on purpose, and it is what the benchmarks measure: requests are looked up (and
prefetched) when queued, admitted under a concurrency limit, computed in a worker thread while
the event loop serves the cache, and timed per token.
"""

from .engine import Engine, EngineStats, RequestHandle
from .request import Request, RequestResult

__all__ = ["Engine", "EngineStats", "RequestHandle", "Request", "RequestResult"]
