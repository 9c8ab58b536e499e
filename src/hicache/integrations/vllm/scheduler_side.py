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

With vLLM's hybrid KV cache manager (several KV cache groups: full and sliding-window layers)
block ids repeat across groups, and vLLM recomputes a load that came up short only for a request
it waits for: loads are then asynchronous, ``(n, True)``, listed in the next step's
``async_loads`` (the worker copies them before that step's forward and reports them received, or
failed: vLLM then recomputes the request, which does not load again). Saves skip no page: they end
before the first page any group holds only in vLLM's null block (behind a sliding window).

Prefill/decode (``handoff.py`` has the worker's half; ``Roles`` what each ``kv_role`` does):

* **Producer**: a request that asked for a remote decode (``kv_transfer_params`` with
  ``do_remote_decode``) and finished its prefill is handed off at ``request_finished``: the
  worker answers how many tokens it holds and their check, and starts making them durable; the
  scheduler keeps the request's blocks (``delay_free_blocks``) until the worker reports it sent,
  and returns ``kv_transfer_params`` (``do_remote_prefill`` and a ``hicache`` section: tokens,
  checks per rank, page size, a fresh hand-off id that names the marker the worker leaves in the
  shared tier if the send fails, and the period of the pulse it leaves while it sends) for the
  proxy to pass to a decode server.
* **Consumer**: a request that carries those parameters has its queued lookup carry them too
  (``expect``); once the worker accepts them, ``get_num_new_matched_tokens`` answers the
  promised whole blocks beyond vLLM's own hit as an asynchronous load ``(n, True)``: vLLM gives
  the request blocks and parks it in ``WAITING_FOR_REMOTE_KVS``; the next step's metadata tells
  the worker the blocks (``ReceiveSpec``), and its ``get_finished`` reports the request received.
  Refused (another namespace) or unanswered, the request is served as any other.

Lookups go to the worker over the side channel (see ``channel.py``); a lookup that fails is a miss.
Under tensor parallelism they go to every rank's worker and the answer is the minimum (``ranks.py``).
Each hook is timed (``profile.py``); the profile rides on the lookup and forget messages to the
worker, which exports it with its own metrics.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass
from typing import Any

from .channel import ChannelClient, pack_tokens
from .layout import NULL_BLOCK
from .metadata import HiCacheMetadata, LoadSpec, ReceiveSpec, SaveSpec
from .profile import SCHEDULER_HOOKS, HookProfile
from .ranks import RankChannels
from .settings import Roles

__all__ = ["SchedulerSide"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own


@dataclass
class _Tracked:
    request: Any  # vllm.v1.request.Request
    block_ids: list[list[int]]  # per KV cache group
    stored_pages: int  # leading pages hicache holds (found by the lookup or saved since)


def _groups(block_ids: Any) -> list[list[int]]:
    """vLLM's block ids of a request, one list per KV cache group, as lists."""
    return [list(ids) for ids in block_ids]


#: what a request that a producer handed off must finish as (not aborted, not an error)
_HANDED_OFF = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


def handoff_params(request: Any) -> dict[str, Any] | None:
    """The ``hicache`` part of a producer's ``kv_transfer_params`` on a request for a decode server,
    if it carries one that is well formed (``tokens``: int, ``checks``: a list of strings)."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        return None
    ours = params.get("hicache")
    if not isinstance(ours, dict):
        return None
    tokens, checks = ours.get("tokens"), ours.get("checks")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        return None
    if not isinstance(checks, list) or not all(isinstance(c, str) for c in checks):
        return None
    return ours  # its ``id`` is checked where the marker is named (handoff.py)


class SchedulerSide:
    def __init__(
        self, client: ChannelClient | RankChannels, page_size: int, block_size: int, roles: Roles | None = None,
        groups: int = 1, mamba_groups: frozenset[int] = frozenset(),
    ) -> None:
        self.client = client
        #: a Mamba hybrid's state groups (``recurrent.py``): their blocks hold states, not KV pages
        self.mamba_groups = mamba_groups
        self.page_size = page_size
        self.block_size = block_size
        self.roles = roles or Roles()
        self.async_loads = groups > 1  # several KV cache groups: loads vLLM waits for (module docstring)
        self._async: list[LoadSpec] = []  # async loads granted this step, for its metadata
        self._local: dict[str, int] = {}  # req_id -> vLLM's own hit at its last lookup (async loads)
        self._failed: set[str] = set()  # requests whose async load came up short: computed, not loaded again
        self._expect: dict[str, int] = {}  # consumer: req_id -> tokens the worker watches for (accepted)
        self._watched: set[str] = set()  # consumer: requests the worker had a receive for (told at finish)
        self._receives: list[ReceiveSpec] = []  # async loads granted this step, for its metadata
        self._hits: dict[str, int] = {}  # req_id -> hicache hit (tokens) at the last lookup
        self._pending: dict[str, int] = {}  # req_id -> external tokens granted, until its first step
        self._tracked: dict[str, _Tracked] = {}
        self.profile = HookProfile(SCHEDULER_HOOKS)
        # req_id -> (usable tokens, hit) of its queued lookup, until the next step is planned
        self._queued: dict[str, tuple[int, int]] = {}
        self._held: set[str] = set()  # requests the worker holds a prefetch for (told at their queued lookup)
        self._offers: dict[str, dict[int, list[tuple[int, int]]]] = {}  # this step's state offers (Mamba)

    def _usable(self, request: Any) -> int:
        """Whole blocks of the request's tokens, leaving at least one token to compute."""
        return (request.num_tokens - 1) // self.block_size * self.block_size

    def _lookup(self, request: Any, prefetch: bool, expect: dict[str, Any] | None = None,
                end: int | None = None) -> tuple[int | None, dict[str, Any] | None]:
        """Whole blocks of the request hicache holds (None: the worker did not answer: a miss),
        and the reply. ``end``: look up that many tokens instead of the usable ones."""
        usable = self._usable(request) if end is None else end
        if usable <= 0:
            return 0, None
        started = time.perf_counter()
        tokens = pack_tokens(request.all_token_ids[:usable])
        message = {"op": "lookup", "req": request.request_id, "tokens": tokens, "prefetch": prefetch,
                   "profile": self.profile.snapshot()}
        if expect is not None:
            message["expect"] = expect
        reply = self.client.call(message)
        if prefetch and (reply is None or reply.get("held", True)):
            self._held.add(request.request_id)  # no answer: it may hold one; say forget to be sure
        self.profile.add("lookup", time.perf_counter() - started)
        if reply is None:
            return None, None
        hit = min(int(reply.get("tokens", 0)), usable, self._usable(request))
        return hit - hit % self.block_size, reply

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
        if self.roles.consumes:
            ours = handoff_params(request)
            if ours is not None and self._expect_handoff(request, ours):
                return
        if self.roles.loads_cached:
            hit, _ = self._lookup(request, prefetch=True)
            if hit is not None:
                self._queued[request.request_id] = (self._usable(request), hit)

    def _expect_handoff(self, request: Any, ours: dict[str, Any]) -> bool:
        """Tell the worker to watch for a producer's pages: the whole blocks of them this request
        can load (at least one prompt token is left to compute). False: not accepted."""
        promised = int(ours["tokens"])
        receive = min(promised, self._usable(request)) // self.block_size * self.block_size
        if receive <= 0 or promised > request.num_tokens:
            return False  # nothing whole to load, or not this prompt: computed here
        _, reply = self._lookup(request, prefetch=True, expect={"tokens": receive, "checks": ours["checks"], "id": ours.get("id"),
                                                                  "pulse_s": ours.get("pulse_s")},
                                end=promised)
        if reply is None or not reply.get("expect"):
            return False
        self._expect[request.request_id] = receive
        self._watched.add(request.request_id)
        return True

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        receive = self._expect.get(request.request_id)
        if receive is not None and receive > num_computed_tokens:
            return receive - num_computed_tokens, True  # asynchronous: the worker reports it received
        hit = self._fresh(request)
        if hit is None:
            hit = self._lookup(request, prefetch=False)[0] or 0
        if request.request_id in self._failed:
            hit = 0  # its load came up short: vLLM recomputes it whole
        self._hits[request.request_id] = hit
        if not self.roles.loads_cached:
            return 0, False  # a producer only: the hit tells its save plan what hicache holds already
        if self.async_loads:
            self._local[request.request_id] = num_computed_tokens
            n = max(0, hit - num_computed_tokens)
            return n, n > 0
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request: Any, num_external_tokens: int, blocks: Any = None) -> None:
        rid = request.request_id
        receive = self._expect.pop(rid, None)
        if receive is not None:
            if num_external_tokens > 0 and blocks is not None:
                ps = self.page_size
                computed = receive - num_external_tokens  # what vLLM's own prefix cache holds
                block_ids = tuple(_groups(blocks.get_block_ids()))
                tokens = list(request.all_token_ids[:receive])
                self._receives.append(ReceiveSpec(rid, tokens, computed // ps, receive // ps, block_ids))
                # Scheduled again once received (update_state_after_alloc with 0): its saves start after these.
                self._hits[rid] = receive
                return
            self._forget(rid, finished=False)  # vLLM holds the prefix itself: nothing to wait for
        local = self._local.pop(rid, None)
        if self.async_loads and num_external_tokens > 0 and local is not None and blocks is not None:
            ps = self.page_size
            end = (local + num_external_tokens) // ps
            tokens = list(request.all_token_ids[: end * ps])
            self._async.append(LoadSpec(rid, tokens, local // ps, end, tuple(_groups(blocks.get_block_ids()))))
            # Scheduled again once loaded (update_state_after_alloc with 0): its saves start after these.
            self._hits[rid] = end * ps
            return
        self._pending[rid] = num_external_tokens
        # (Re)scheduled from the waiting queue, maybe after a preemption: plan from scratch.
        self._tracked[request.request_id] = _Tracked(
            request=request,
            block_ids=[],
            stored_pages=self._hits.pop(request.request_id, 0) // self.page_size,
        )

    def receiving(self, req_id: str) -> bool:
        """Whether ``req_id``'s external tokens come from a prefill server (planned this step)."""
        return any(spec.req_id == req_id for spec in self._receives)

    def build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        started = time.perf_counter()
        self._queued.clear()  # a step is planned: the answers of requests still waiting are stale now
        try:
            return self._build_meta(scheduler_output)
        finally:
            self.profile.add("plan", time.perf_counter() - started)

    def _build_meta(self, scheduler_output: Any) -> HiCacheMetadata:
        meta = HiCacheMetadata()
        meta.receives, self._receives = self._receives, []
        meta.async_loads, self._async = self._async, []
        steps = scheduler_output.num_scheduled_tokens
        self._offers = self._state_offers(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                continue
            tracked.block_ids = _groups(new.block_ids)
            self._plan_load(meta, tracked, new.req_id, new.num_computed_tokens)
            self._plan_save(meta, tracked, new.req_id, new.num_computed_tokens, steps.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if new_blocks is not None:
                if req_id in cached.resumed_req_ids or len(tracked.block_ids) != len(new_blocks):
                    tracked.block_ids = _groups(new_blocks)
                else:
                    for ids, new_ids in zip(tracked.block_ids, new_blocks):
                        ids.extend(new_ids)
            if req_id in cached.resumed_req_ids:  # back from a preemption: it may load again
                self._plan_load(meta, tracked, req_id, cached.num_computed_tokens[i])
            self._plan_save(meta, tracked, req_id, cached.num_computed_tokens[i], steps.get(req_id, 0))
        return meta

    def _state_offers(self, scheduler_output: Any) -> dict[str, dict[int, list[tuple[int, int]]]]:
        """A Mamba hybrid's block-boundary states this step writes, per request: tokens -> [(group,
        block)], only boundaries every Mamba group offers (vLLM drains its offers each step)."""
        if not self.mamba_groups:
            return {}
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(state, "boundary_state_offloads", None) or {}
        out: dict[str, dict[int, list[tuple[int, int]]]] = {}
        for req_id, items in offers.items():
            by_tokens: dict[int, list[tuple[int, int]]] = {}
            for group, block, tokens in items:
                if group in self.mamba_groups and block != NULL_BLOCK:
                    by_tokens.setdefault(int(tokens), []).append((int(group), int(block)))
            whole = {t: v for t, v in by_tokens.items() if {g for g, _ in v} == self.mamba_groups}
            if whole:
                out[req_id] = whole
        return out

    def _plan_load(self, meta: HiCacheMetadata, tracked: _Tracked, req_id: str, computed: int) -> None:
        ext = self._pending.pop(req_id, 0)
        if ext <= 0:
            return
        ps = self.page_size
        first, end = (computed - ext) // ps, computed // ps
        tokens = list(tracked.request.all_token_ids[: end * ps])
        meta.loads.append(LoadSpec(req_id, tokens, first, end, tuple(list(ids) for ids in tracked.block_ids)))

    def _plan_save(self, meta: HiCacheMetadata, tracked: _Tracked, req_id: str, computed: int, scheduled: int) -> None:
        if not self.roles.saves:
            return  # a consumer only: what it decodes is not kept
        ps = self.page_size
        # vLLM may have rewound the request (a failed load is recomputed): pages past what is
        # computed now were never stored, so plan them again.
        if computed < tracked.stored_pages * ps:
            tracked.stored_pages = computed // ps
        end = (computed + scheduled) // ps
        kv_groups = [ids for g, ids in enumerate(tracked.block_ids) if g not in self.mamba_groups]
        have_blocks = min((len(ids) for ids in kv_groups), default=0) * self.block_size // ps
        end = min(end, have_blocks)
        first = tracked.stored_pages
        per = self.block_size // ps
        for j in range(first, end):  # a page no group may miss: behind a sliding window, vLLM kept none
            if any(ids[j // per] == NULL_BLOCK for ids in kv_groups):
                end = j
                break
        if end <= first:
            return
        tokens = list(tracked.request.all_token_ids[: end * ps])
        if len(tokens) < end * ps:
            return  # the tokens are not known yet (cannot happen for computed tokens)
        offers = self._offers.get(req_id, {})
        states = tuple((g, block, t) for t in sorted(offers) if first * ps < t <= end * ps for g, block in offers[t])
        meta.saves.append(SaveSpec(req_id, tokens, first, end - first, tuple(list(ids) for ids in tracked.block_ids),
                                   states))
        tracked.stored_pages = end

    def request_finished(self, request: Any, block_ids: Any = ()) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; a producer's prefill for a remote decode is handed off (see above):
        ``(keep its blocks until reported sent, kv_transfer_params)``."""
        started = time.perf_counter()
        rid = request.request_id
        self._tracked.pop(rid, None)
        self._pending.pop(rid, None)
        self._hits.pop(rid, None)
        self._queued.pop(rid, None)
        self._expect.pop(rid, None)
        self._local.pop(rid, None)
        self._failed.discard(rid)
        if rid in self._held or rid in self._watched:
            self._forget(rid, finished=True)
        result: tuple[bool, dict[str, Any] | None] = (False, None)
        if self.roles.produces:
            result = self._handoff(request)
        self.profile.add("finish", time.perf_counter() - started)
        return result

    def loads_failed(self, req_ids: set[str]) -> None:
        """vLLM's worker reported these async loads short (``failed_recving``): they are computed."""
        self._failed.update(req_ids)

    def _forget(self, rid: str, *, finished: bool) -> None:
        self._held.discard(rid)
        if finished:
            self._watched.discard(rid)
        self.client.call({"op": "forget", "req": rid, "finished": finished, "profile": self.profile.snapshot()})

    def _handoff(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return False, None
        if getattr(request.status, "name", str(request.status)) not in _HANDED_OFF:
            return False, None  # aborted or failed: no decode follows
        ps = self.page_size
        prompt = list(request.prompt_token_ids or [])
        end = (len(prompt) - 1) // ps * ps  # whole pages a decode server could load (one token left to compute)
        if end <= 0:
            return False, None
        handoff_id = secrets.token_hex(8)  # names the marker left if the send fails (handoff.py)
        reply = self.client.call({"op": "handoff", "req": request.request_id, "tokens": prompt[:end], "id": handoff_id})
        tokens = 0 if reply is None else int(reply.get("tokens", 0))
        if tokens <= 0:
            log.info("hicache: %s: nothing to hand off (the worker holds none of its pages, or did not answer)",
                     request.request_id)
            return False, None
        checks = reply.get("checks") if isinstance(reply.get("checks"), list) else [reply.get("check")]
        ours: dict[str, Any] = {"tokens": tokens, "checks": checks, "page_size": ps, "id": handoff_id}
        if reply.get("pulse_s") is not None:
            ours["pulse_s"] = reply["pulse_s"]  # the worker pulses while it sends (handoff.py)
        return True, {"do_remote_prefill": True, "do_remote_decode": False, "hicache": ours}
