"""The connector's scheduler half: what hicache holds beyond vLLM's own prefix cache, and what each
step must load and save.

* When a request is queued (``on_new_request``) it looks the prompt up with ``prefetch=True``, so
  pages that only a storage tier holds start coming into the worker's host tier while the request
  waits.
* When vLLM schedules it (``get_num_new_matched_tokens``) it looks up again, without side effects,
  unless no step was planned since the queued lookup (the request is scheduled by the first
  ``schedule()`` after it arrived, the common case without a queue): then the queued answer is
  used, which saves a channel round trip a request (see ``_fresh``). It answers the whole vLLM
  blocks hicache holds beyond vLLM's local hit, always leaving at least
  one prompt token to compute (vLLM needs its logits). Whole blocks, not pages: with vLLM 0.32 on
  CPU, a computed prefix that ends inside a block changes later greedy tokens (measured with
  32-token pages under 128-token blocks: outputs diverged after 2-5 tokens; block-aligned loads
  are identical to vLLM alone). The load is synchronous: it runs layer by
  layer inside the step's forward.
* Each step (``build_connector_meta``) it lists the loads of newly scheduled requests and, for
  every scheduled request, the full pages its forward completes that hicache does not hold yet.
* When a request finishes or is aborted it tells the worker to drop its prefetch (only a request
  whose queued lookup left one held: the others cost no round trip).

Lookups go to the worker over the side channel (see ``channel.py``); a lookup that fails is a miss.
Under tensor parallelism they go to every rank's worker and the answer is the minimum (``ranks.py``).
Each hook is timed (``profile.py``); the profile rides on the lookup and forget messages to the
worker, which exports it with its own metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .channel import ChannelClient, pack_tokens
from .metadata import HiCacheMetadata, LoadSpec, SaveSpec
from .profile import SCHEDULER_HOOKS, HookProfile
from .ranks import RankChannels

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    block_ids: list[int]
    stored_pages: int  # leading pages hicache holds (found by the lookup or saved since)


class SchedulerSide:
    def __init__(self, client: ChannelClient | RankChannels, page_size: int, block_size: int) -> None:
        self.client = client
        self.page_size = page_size
        self.block_size = block_size
        self._hits: dict[str, int] = {}  # req_id -> hicache hit (tokens) at the last lookup
        self._pending: dict[str, int] = {}  # req_id -> external tokens granted, until its first step
        self._tracked: dict[str, _Tracked] = {}
        self.profile = HookProfile(SCHEDULER_HOOKS)
        # req_id -> (usable tokens, hit) of its queued lookup, until the next step is planned
        self._queued: dict[str, tuple[int, int]] = {}
        self._held: set[str] = set()  # requests the worker holds a prefetch for (told at their queued lookup)

    def _usable(self, request: Any) -> int:
        """Whole blocks of the request's tokens, leaving at least one token to compute."""
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def _lookup(self, request: Any, prefetch: bool) -> int | None:
        """Whole blocks of the request hicache holds (None: the worker did not answer: a miss)."""
        usable = self._usable(request)
        if usable <= 0:
            return 0
        started = time.perf_counter()
        tokens = pack_tokens(request.all_token_ids[:usable])
        reply = self.client.call({"op": "lookup", "req": request.request_id, "tokens": tokens, "prefetch": prefetch,
                                  "profile": self.profile.snapshot()})
        if prefetch and (reply is None or reply.get("held", True)):
            self._held.add(request.request_id)  # no answer: it may hold one; say forget to be sure
        self.profile.add("lookup", time.perf_counter() - started)
        if reply is None:
            return None
        hit = min(int(reply.get("tokens", 0)), usable)
        return hit - hit % self.block_size

    def _fresh(self, request: Any) -> int | None:
        """The queued lookup's answer if no step was planned since it (None: look up again).

        Between a request's arrival and the first ``schedule()`` after it no step of this
        scheduler has been planned, so the index can only have changed by the steps planned before
        the arrival that were still running (their saves are blocks vLLM's own prefix cache holds
        too, which the local hit covers) and by evictions (a load that then comes up short is
        recomputed, as for any eviction between the lookup and the load). A request that waited a
        step or more is looked up again: pages saved or prefetched meanwhile count.
        """
        queued = self._queued.pop(request.request_id, None)
        if queued is None:
            return None
        usable, hit = queued
        if usable != self._usable(request):
            return None
        self.profile.add("lookup_reused", 0.0)
        return hit

    # -- vLLM hooks -----------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        hit = self._lookup(request, prefetch=True)
        if hit is not None:
            self._queued[request.request_id] = (self._usable(request), hit)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        hit = self._fresh(request)
        if hit is None:
            hit = self._lookup(request, prefetch=False) or 0
        self._hits[request.request_id] = hit
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, num_external_tokens: int) -> None:
        self._pending[request.request_id] = num_external_tokens
        # (Re)scheduled from the waiting queue, maybe after a preemption: plan from scratch.
        self._tracked[request.request_id] = _Tracked(
            request=request,
            block_ids=[],
            stored_pages=self._hits.pop(request.request_id, 0) // self.page_size,
        )

    def build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        started = time.perf_counter()
        self._queued.clear()  # a step is planned: the answers of requests still waiting are stale now
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.profile.add("plan", time.perf_counter() - started)

    def _build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        meta = HiCacheMetadata()
        steps = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = list(new.block_ids[0])
            self._plan_load(meta, tracked, new.req_id, new.num_computed_tokens)
            self._plan_save(meta, tracked, new.req_id, new.num_computed_tokens, steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids:
                    tracked.block_ids = list(new_blocks[0])
                else:
                    tracked.block_ids.extend(new_blocks[0])
            if req_id in cached.resumed_req_ids:  # back from a preemption: it may load again
                self._plan_load(meta, tracked, req_id, cached.num_computed_tokens[i])
            self._plan_save(meta, tracked, req_id, cached.num_computed_tokens[i], steps.get(req_id, 0))
        return meta

    def _plan_load(self, meta: HiCacheMetadata, tracked: _Tracked, req_id: str, computed: int) -> None:
        ext = self._pending.pop(req_id, 0)
        if ext <= 0:
            return
        ps = self.page_size
        first, end = (computed - ext) // ps, computed // ps
        tokens = list(tracked.request.all_token_ids[: end * ps])
        meta.loads.append(LoadSpec(req_id, tokens, first, end, list(tracked.block_ids)))

    def _plan_save(self, meta: HiCacheMetadata, tracked: _Tracked, req_id: str, computed: int, scheduled: int) -> None:
        ps = self.page_size
        # vLLM may have rewound the request (a failed load is recomputed): pages past what is
        # computed now were never stored, so plan them again.
        if computed < tracked.stored_pages * ps:
            tracked.stored_pages = computed // ps
        end = (computed + scheduled) // ps
        have_blocks = len(tracked.block_ids) * self.block_size // ps
        end = min(end, have_blocks)
        if end <= tracked.stored_pages:
            return
        first = tracked.stored_pages
        tokens = list(tracked.request.all_token_ids[: end * ps])
        if len(tokens) < end * ps:
            return  # the tokens are not known yet (cannot happen for computed tokens)
        meta.saves.append(SaveSpec(req_id, tokens, first, end - first, list(tracked.block_ids)))
        tracked.stored_pages = end

    def request_finished(self, request: Any) -> None:
        started = time.perf_counter()
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._pending.pop(rid, None)
        self._hits.pop(rid, None)
        self._queued.pop(rid, None)
        if rid in self._held:
            self._held.discard(rid)
            self.client.call({"op": "forget", "req": rid, "profile": self.profile.snapshot()})
        self.profile.add("finish", time.perf_counter() - started)
