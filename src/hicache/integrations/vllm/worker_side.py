"""The connector's worker half: copies pages between vLLM's blocks and hicache.

Per step (vLLM calls these in order): ``bind`` leases what the step needs: for each load the
cached pages after the request's own prefix-cache hit, held where they lie (``HiCache.hold``:
the host tier, after a storage prefetch brought them there), and for each save fresh host pages
(``reserve(n, tier="host")``). Before the first layer's attention, ``before_layer`` copies the held
pages, every layer, straight into the request's vLLM blocks; ``after_layer`` notes each layer whose
attention has run, and ``end_step`` copies the new pages of every layer straight into the reserved
host pages: one strided copy per run of pages and layer, the layout conversion included
(``layout.py``), no staging pool between, all in one call into torch (``copy_all``). The copies run
on vLLM's thread either way on the CPU; one call a step instead of one a layer gives the GIL up
once, not 30 times beside the cache's threads (the connector's load and save took 4.0 ms a
request layer by layer, 3.3 ms at once, one run each). ``end_step`` then hands the step to the
cache's loop, which commits the saved pages (hicache then writes them to storage in the
background) and releases every lease, steps in order, while vLLM goes on with the next step. A
load that comes up short is reported as failed blocks, which vLLM recomputes
(``kv_load_failure_policy="recompute"``); a request whose load failed saves nothing that step,
nor does a step whose forward did not reach every layer. Without a host tier the pages live on
the device tier instead, by the same path.

With vLLM's hybrid KV cache manager (a model with full and sliding-window layers) each KV cache
group has its own block table, and vLLM can take back a load that came up short only for a
request it waits for: such loads come as ``async_loads``, are copied in ``bind`` (every layer,
each into its group's blocks, none into a sliding group's null blocks) and are reported received,
or failed, through ``get_finished``. Pages held *thin* (their sliding layers absent) are never
copied into a block vLLM keeps (``BlockLayout.first_unfit``): the load is cut before them.
"""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from anyio.from_thread import BlockingPortal, start_blocking_portal

from ...config import HiCacheConfig
from ...errors import HiCacheError
from .cpus import reserved_cpus, use_cpus
from .gil import shortened_switch_interval
from .layout import BlockLayout, CopyRun, copy_all
from .metadata import HiCacheMetadata, LoadSpec
from .recurrent import state_blocks, state_from_pages, state_to_pages
from .service import CacheService, StepLeases
from .settings import ConnectorOptions

__all__ = ["WorkerSide"]

log = logging.getLogger("vllm.hicache")  # under vLLM's logger: its handlers print our lines with its own

_IDLE_STEP_S = 0.002  # get_finished called again this soon: vLLM is stepping without a forward
_IDLE_STEP_WAIT_S = 0.005  # how long such a call may wait for a hand-off to end


@dataclass
class _Step:
    meta: HiCacheMetadata
    leases: StepLeases | None = None
    # per load: (spec, [(the tier's pages_view per layer, runs per KV cache group)], tokens loaded, tokens by tier)
    loads: list[tuple[LoadSpec, list[tuple[list[Any], list[list[CopyRun]]]], int, dict[str, int]]] = field(
        default_factory=list)
    saves: list[tuple[list[Any], list[list[CopyRun]]]] = field(default_factory=list)  # (pages_view per layer, runs per group)
    failed_reqs: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    recompute_from: dict[str, int] = field(default_factory=dict)  # request -> first token vLLM recomputes
    loaded: bool = False  # the held pages have been copied into vLLM's blocks (at the first layer)
    saved_layers: set[str] = field(default_factory=set)  # layers whose attention has run: their new pages are final
    # a Mamba hybrid's states (recurrent.py): (tier, page, [(model layer, vLLM block)]) to copy in / out
    state_loads: list[tuple[Any, int, list[tuple[int, int]]]] = field(default_factory=list)
    state_saves: list[tuple[Any, int, list[tuple[int, int]]]] = field(default_factory=list)


class WorkerSide:
    """Owns the event-loop thread, the ``CacheService`` in it, and vLLM's per-layer KV tensors."""

    def __init__(
        self, config: HiCacheConfig, block_size: int, socket_path: str, options: ConnectorOptions | None = None,
        layer_groups: dict[str, int] | None = None,
    ) -> None:
        self.config = config
        self.options = options or ConnectorOptions()
        self.layout = BlockLayout(
            block_size=block_size,
            page_size=config.page_size,
            num_kv_heads=config.model.num_kv_heads,
            head_dim=config.model.head_dim,
        )
        self.socket_path = socket_path
        self.layers: dict[str, tuple[int, Any, int]] = {}  # name -> (cache layer, its blocks_view, its KV cache group)
        self.states: dict[int, tuple[torch.Tensor, int]] = {}  # Mamba layer -> ([blocks, state bytes], its group)
        self.state_groups: frozenset[int] = frozenset()  # their KV cache groups
        self.layer_groups = dict(layer_groups or {})  # name -> vLLM's KV cache group (absent: 0)
        self.sliding_groups: frozenset[int] = frozenset()  # groups holding a sliding-window layer
        self._async_done: list[tuple[str, bool]] = []  # async loads copied since vLLM last asked: (request, whole)
        self._pages: dict[int, tuple[torch.Tensor, list[Any]]] = {}  # id(tier) -> (its buffer, pages_view per layer)
        self._exit = ExitStack()
        self.portal: BlockingPortal | None = None
        self.service: CacheService | None = None
        self._step: _Step | None = None
        self._errors: set[int] = set()
        self._exported = 0  # sequence number of the last export handed to vLLM
        self._last_finished_call = 0.0  # when vLLM last asked for finished hand-offs (perf_counter)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's KV tensors and open the cache (vLLM's ``register_kv_caches``)."""
        from vllm.model_executor.models.utils import extract_layer_index

        if len(kv_caches) != self.config.model.num_layers:
            log.warning("hicache: vLLM has %d KV layers, the model config %d", len(kv_caches), self.config.model.num_layers)
        kinds = self.config.model.layers
        sliding = set(kinds.sliding)
        # Where each model layer lies in a page (a recurrent layer's state takes several cache layers).
        slots = kinds.slots(self.config.slot_bytes) if kinds.recurrent else ()
        sliding_groups = set()
        for name, kv in kv_caches.items():
            index, group = extract_layer_index(name), self.layer_groups.get(name, 0)
            if index in kinds.recurrent:
                self.states[index] = (state_blocks(name, kv, kinds[index].state_bytes), group)
                continue
            self.layout.check_layer(name, kv)
            self.layers[name] = (slots[index][0] if slots else index, self.layout.blocks_view(kv), group)
            if index in sliding:
                sliding_groups.add(group)
        self.sliding_groups = frozenset(sliding_groups)
        self._state_slots = {i: slots[i] for i in self.states}
        self.state_groups = frozenset(g for _, g in self.states.values())
        self._group_layers = {g: [i for i, (_, h) in self.states.items() if h == g] for g in self.state_groups}
        try:
            self._exit.enter_context(shortened_switch_interval(self.options.gil_switch_interval_s))
            self.portal = self._exit.enter_context(start_blocking_portal())
            cpus = reserved_cpus()
            if cpus is not None:  # before the cache starts: its I/O threads inherit the loop thread's CPUs
                self.portal.call(use_cpus, cpus[1])
                log.info("hicache: the cache's threads run on CPUs %s (vLLM's reserved cores; its threads "
                         "are bound to %s)", sorted(cpus[1]), sorted(cpus[0]))
            else:
                log.info("hicache: no CPU is left over from vLLM's threads; the cache's threads run beside them")
            self.service = self._exit.enter_context(
                self.portal.wrap_async_context_manager(CacheService(self.config, self.socket_path, self.options))
            )
        except BaseException:
            self._exit.close()
            raise
        log.info(
            "hicache: cache open for %s (page %d tokens, vLLM block %d), channel %s",
            self.config.model.name, self.config.page_size, self.layout.block_size, self.socket_path,
        )

    def shutdown(self) -> None:
        """Close the cache: its drain writes what the write policy owes storage (logged with counts)."""
        if self.service is not None:
            log.info(
                "hicache: shutting down; draining what the %s policy owes storage (at most %.1f s)",
                self.config.policies.write, self.config.controller.shutdown_timeout_s,
            )
        self._exit.close()
        self.portal = None
        self.service = None
        self._pages.clear()

    def take_export(self) -> list[Any] | None:
        """The service's newest metrics export, if vLLM has not had it yet (never waits on the loop)."""
        service = self.service
        if service is None:
            return None
        started = time.perf_counter()
        payload = service.payload
        if payload is None or payload[0] == self._exported:
            return None
        self._exported = payload[0]
        service.worker_profile.add("stats", time.perf_counter() - started)
        return payload[1]

    def events_journal(self) -> Any:
        """The cache's KV event journal (None when events are off or the cache is not open)."""
        service = self.service
        cache = service.cache if service is not None else None
        return cache.events if cache is not None else None

    @property
    def _portal(self) -> BlockingPortal:
        assert self.portal is not None, "register_kv_caches has not run"
        return self.portal

    @property
    def _service(self) -> CacheService:
        assert self.service is not None, "register_kv_caches has not run"
        return self.service

    # -- per step -------------------------------------------------------------------------------

    def bind(self, meta: HiCacheMetadata) -> None:
        """Lease the step's held prefixes and reservations; plan the per-layer copies."""
        started = time.perf_counter()
        try:
            self._bind(meta)
        finally:
            if self.service is not None:
                step = self._step
                wait = step.leases.hold_s if step is not None and step.leases is not None else 0.0
                if wait:
                    self.service.worker_profile.add("load_wait", wait)
                self.service.worker_profile.add("bind", time.perf_counter() - started - wait)

    def _bind(self, meta: HiCacheMetadata) -> None:
        if self._step is not None:
            self.end_step()  # a step vLLM ended without wait_for_save: release it first
        step = _Step(meta)
        self._step = step
        if meta.receives:  # prefill/decode: copied in by the cache when the pages arrive (handoff.py)
            self._portal.call(self._service.begin_receives, meta.receives, self._copy_received)
        if meta.async_loads:
            self._load_now(meta.async_loads)
        if not meta.loads and not meta.saves:
            return
        try:
            step.leases = self._portal.call(self._service.open_step, meta.loads, meta.saves)
        except HiCacheError as exc:  # the cache closed or a worker of it failed: vLLM recomputes
            log.error("hicache: step not served: %r", exc)
            for spec in meta.loads:
                self._fail(step, spec, spec.first_page)
            self._errors |= step.failed_blocks
            self._step = None
            return
        try:
            self._plan(step)
        except HiCacheError as exc:  # a tier closed under the step: nothing is copied, vLLM recomputes
            log.error("hicache: step not served: %r", exc)
            for spec in meta.loads:
                self._fail(step, spec, spec.first_page)
            step.loads, step.saves = [], []
            step.failed_reqs.update(spec.req_id for spec in meta.saves)

    def _plan(self, step: _Step) -> None:
        """The step's copies, per load and save: the pages' views and the runs between them and vLLM's blocks."""
        assert step.leases is not None
        meta, ps = step.meta, self.layout.page_size
        for spec, held in zip(meta.loads, step.leases.holds):
            got = 0 if held is None else min(held.tokens // ps, spec.end_page)
            if got < spec.end_page:
                log.info(
                    "hicache: load for %s came up short: %d of pages %d..%d (%s); vLLM recomputes the rest",
                    spec.req_id, max(got - spec.first_page, 0), spec.first_page, spec.end_page,
                    "nothing held" if held is None else dict(held.by_tier),
                )
                self._fail(step, spec, max(got, spec.first_page))
            if held is None or got <= spec.first_page:
                continue
            fit = self.layout.first_unfit(spec.block_ids, self.sliding_groups, spec.first_page, got, held.thin)
            if fit < got:
                log.info("hicache: load for %s cut at page %d of %d..%d: pages from there are held without their "
                         "sliding layers and vLLM keeps their blocks; vLLM recomputes the rest",
                         spec.req_id, fit, spec.first_page, spec.end_page)
                self._fail(step, spec, fit)
                got = fit
                if got <= spec.first_page:
                    continue
            plans, page = [], spec.first_page
            last: tuple[Any, int] | None = None  # the tier and page holding the load's last token page
            for tier, pages in held.segments:
                pages = pages[: got - page]
                if pages:
                    runs = self.layout.group_runs(spec.block_ids, page, pages, self.state_groups)
                    plans.append((self._views(tier), runs))
                    page += len(pages)
                    last = (tier, pages[-1])
            if self.states and not self._plan_state_load(step, spec, held, got, last):
                continue
            by_tier = {t: n for t, n in held.by_tier.items() if n}
            step.loads.append((spec, plans, (got - spec.first_page) * ps, by_tier))
        for spec, res in zip(meta.saves, step.leases.reservations):
            if res is not None and spec.req_id not in step.failed_reqs:
                runs = self.layout.group_runs(spec.block_ids, spec.first_page, res.pages, self.state_groups)
                step.saves.append((self._views(res.tier), runs))
                for tokens in spec.checkpoints:
                    page = res.pages[tokens // ps - 1 - spec.first_page]
                    copies = [(i, block) for g, block, t in spec.states if t == tokens
                              for i in self._group_layers.get(g, ())]
                    step.state_saves.append((res.tier, page, copies))

    def _plan_state_load(self, step: _Step, spec: LoadSpec, held: Any, got: int, last: tuple[Any, int] | None) -> bool:
        """A Mamba hybrid's load: the checkpoint on its last page goes into each Mamba group's block
        at the hit's last block boundary (``recurrent.py``). False (the load failed whole) where the
        load is short, its last page is thin (no checkpoint) or vLLM gave no block there."""
        ps, bs = self.layout.page_size, self.layout.block_size
        thin = any(a <= got - 1 < b for a, b in held.thin)
        k = got * ps // bs
        blocks = [(i, spec.block_ids[g][k - 1] if 0 < k <= len(spec.block_ids[g]) else 0)
                  for i, (_, g) in self.states.items()]
        if got < spec.end_page or last is None or thin or got * ps % bs or any(b == 0 for _, b in blocks):
            log.info("hicache: load for %s has no Mamba checkpoint at token %d; vLLM recomputes it",
                     spec.req_id, got * ps)
            self._fail(step, spec, spec.first_page)
            step.failed_reqs.add(spec.req_id)
            return False
        step.state_loads.append((last[0], last[1], blocks))
        return True

    def _views(self, tier: Any) -> list[Any]:
        """``tier``'s pages as ``pages_view`` per layer, made once (a tier's buffer lives as long as the cache)."""
        buffer = tier.buffer  # raises CacheClosedError once the tier has closed
        got = self._pages.get(id(tier))
        if got is None or got[0] is not buffer:
            got = (buffer, [self.layout.pages_view(tier.layer_view(i)) for i in range(tier.geometry.num_layers)])
            self._pages[id(tier)] = got
        return got[1]

    def _fail(self, step: _Step, spec: LoadSpec, from_page: int) -> None:
        """Pages ``from_page..end_page`` of ``spec`` cannot be loaded: report their blocks."""
        ps, bs = self.layout.page_size, self.layout.block_size
        first_block = from_page * ps // bs
        last_block = (spec.end_page * ps - 1) // bs
        step.failed_blocks.update(spec.block_ids[0][first_block : last_block + 1])  # one group: no async loads
        step.failed_reqs.add(spec.req_id)
        at = first_block * bs
        step.recompute_from[spec.req_id] = min(at, step.recompute_from.get(spec.req_id, at))

    def before_layer(self, name: str) -> None:
        """Before the step's first attention layer: every layer of its held pages is copied into
        vLLM's blocks, in one call into torch (``copy_all``): on the CPU a copy runs on vLLM's
        thread either way, and one call gives the GIL up once, not once a layer."""
        step = self._step
        if step is None or not step.loads or step.loaded or name not in self.layers:
            return
        started = time.perf_counter()
        step.loaded = True
        try:
            self._copy_loads(step)
        except HiCacheError as exc:  # the cache closed under the step: its pages cannot be read
            log.error("hicache: load of the step failed: %r; vLLM recomputes", exc)
            for spec, _, _, _ in step.loads:
                self._fail(step, spec, spec.first_page)
            step.loads = []
        finally:
            self._service.worker_profile.add("load", time.perf_counter() - started)

    def _copy_loads(self, step: _Step) -> None:
        copy_all([pair for layer, blocks, group in self.layers.values() for _, plans, _, _ in step.loads
                  for pages, runs in plans for pair in self.layout.copy_in_runs(pages[layer], blocks, runs[group])])
        for tier, page, copies in step.state_loads:
            for i, block in copies:
                state_from_pages(self._state_views(tier, i), page, self.states[i][0][block])

    def _state_views(self, tier: Any, layer: int) -> list[torch.Tensor]:
        """Mamba layer ``layer``'s ``state`` cache layers of ``tier`` (``layer_view`` each)."""
        first, count = self._state_slots[layer]
        return [tier.layer_view(j) for j in range(first, first + count)]

    def _load_now(self, specs: list[LoadSpec]) -> None:
        """Loads vLLM waits for (several KV cache groups): held, copied every layer and released
        now, before the step's forward; reported by ``take_finished``. One that comes up short
        is reported failed whole: vLLM recomputes such a request from its first token."""
        step = _Step(HiCacheMetadata(loads=specs))
        started = time.perf_counter()
        try:
            step.leases = self._portal.call(self._service.open_step, specs, [])
            self._plan(step)
            if step.loads:
                self._copy_loads(step)
        except HiCacheError as exc:  # the cache closed or a worker of it failed: vLLM recomputes
            log.error("hicache: loads not served: %r", exc)
            step.failed_reqs.update(spec.req_id for spec in specs)
        finally:
            ps = self.layout.page_size
            loaded = {spec.req_id: (tokens, by_tier) for spec, _, tokens, by_tier in step.loads}
            records = []
            for spec in specs:
                whole = spec.req_id not in step.failed_reqs
                tokens, by_tier = loaded.get(spec.req_id, (0, {})) if whole else (0, {})
                records.append((spec.req_id, tokens, by_tier, (spec.end_page - spec.first_page) * ps - tokens))
                if tokens:
                    log.info("hicache: loaded %d tokens for %s %s", tokens, spec.req_id, by_tier)
                self._async_done.append((spec.req_id, whole))
            if step.leases is not None:
                self._service.schedule_finish(step.leases, None, set(), records)
            self._service.worker_profile.add("load", time.perf_counter() - started)

    def after_layer(self, name: str, kv: torch.Tensor) -> None:
        """After layer ``name``'s attention its new pages are final; they are copied, every layer at
        once, when the step ends (``end_step``)."""
        step = self._step
        if step is not None and step.saves and name in self.layers:
            step.saved_layers.add(name)

    def _copy_saves(self, step: _Step) -> None:
        """The step's new full pages, every layer vLLM computed, into the reserved host pages. A
        step whose forward did not reach every layer saves nothing (its pages would be partial)."""
        if not step.saves:
            return
        started = time.perf_counter()
        try:
            if len(step.saved_layers) != len(self.layers):
                if step.saved_layers:
                    log.warning("hicache: step saved %d of %d layers; its pages are not kept",
                                len(step.saved_layers), len(self.layers))
                step.failed_reqs.update(spec.req_id for spec in step.meta.saves)  # counted as skipped
                return
            copy_all([pair for layer, blocks, group in self.layers.values() for pages, runs in step.saves
                      for pair in self.layout.copy_out_runs(blocks, pages[layer], runs[group])])
            for tier, page, copies in step.state_saves:
                for i, block in copies:
                    state_to_pages(self.states[i][0][block], self._state_views(tier, i), page)
        except HiCacheError as exc:
            log.error("hicache: save of the step failed: %r; the step saves nothing", exc)
            step.failed_reqs.update(spec.req_id for spec in step.meta.saves)
        finally:
            self._service.worker_profile.add("save", time.perf_counter() - started)

    def end_step(self) -> None:
        """Commit what was saved, record what was loaded, release every lease of the step."""
        step, self._step = self._step, None
        if step is None or step.leases is None:
            return
        try:
            self._copy_saves(step)
        except BaseException:  # an unexpected copy error: nothing is committed, the leases still go
            step.failed_reqs.update(spec.req_id for spec in step.meta.saves)
            raise
        finally:
            started = time.perf_counter()
            try:
                self._end_step(step)
            finally:
                self._service.worker_profile.add("commit", time.perf_counter() - started)

    def _end_step(self, step: _Step) -> None:
        service = self._service
        ps = self.layout.page_size
        loaded = {spec.req_id: (tokens, by_tier) for spec, _, tokens, by_tier in step.loads}
        records = []
        for spec in step.meta.loads:
            tokens, by_tier = loaded.get(spec.req_id, (0, {}))
            if spec.req_id in step.recompute_from:  # vLLM keeps what precedes the first failed block
                kept = max(0, min(tokens, step.recompute_from[spec.req_id] - spec.first_page * ps))
                by_tier = _scale(by_tier, kept, tokens)
                tokens = kept
            failed = (spec.end_page - spec.first_page) * ps - tokens
            records.append((spec.req_id, tokens, by_tier, failed))
            if tokens:
                log.info("hicache: loaded %d tokens for %s %s", tokens, spec.req_id, by_tier)
        self._errors |= step.failed_blocks
        saves = step.meta.saves if step.saves else None
        service.schedule_finish(step.leases, saves, step.failed_reqs, records)  # returns at once

    def take_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # -- prefill/decode hand-offs (handoff.py) ----------------------------------------------------

    def take_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """vLLM's ``get_transfer_results``: hand-offs made durable (sent), hand-offs and loads vLLM
        waited for copied in (received), and those of them that came up short (failed: vLLM
        recomputes them whole). What a hand-off's receive missed goes to ``take_errors``."""
        done, self._async_done = self._async_done, []
        failed = {rid for rid, whole in done if not whole}
        service = self.service
        if service is None:
            return set(), {rid for rid, _ in done}, failed
        now = time.perf_counter()
        # Asked again within a millisecond or two: a step without a forward (requests only waiting
        # for transfers): let the call wait a little for one to end instead of spinning.
        wait = _IDLE_STEP_WAIT_S if now - self._last_finished_call < _IDLE_STEP_S else 0.0
        self._last_finished_call = now
        sent, received = service.handoffs.take(finished_req_ids, wait)
        ps, bs = self.layout.page_size, self.layout.block_size
        for outcome in received:
            spec = outcome.spec
            if outcome.from_page < spec.end_page:
                first_block = outcome.from_page * ps // bs
                last_block = (spec.end_page * ps - 1) // bs
                if len(spec.block_ids) > 1:  # vLLM maps no block id back to a request with several groups
                    failed.add(spec.req_id)
                else:
                    self._errors.update(spec.block_ids[0][first_block : last_block + 1])
        return sent, {outcome.spec.req_id for outcome in received} | {rid for rid, _ in done}, failed

    def _copy_received(self, block_ids: tuple[list[int], ...], first_page: int, segments: list[tuple[Any, list[int]]],
                       thin: tuple[tuple[int, int], ...] = ()) -> int:
        """In a cache thread: held pages from token page ``first_page`` on into a waiting request's
        blocks, every layer (vLLM runs no forward over these blocks until they are reported); the
        pages copied (fewer where a thin page would land in a block vLLM keeps)."""
        end = first_page + sum(len(pages) for _, pages in segments)
        end = self.layout.first_unfit(block_ids, self.sliding_groups, first_page, end, thin)
        plans, page = [], first_page
        for tier, pages in segments:
            pages = pages[: end - page]
            if pages:
                plans.append((self._views(tier), self.layout.group_runs(block_ids, page, pages, self.state_groups)))
                page += len(pages)
        copy_all([pair for layer, blocks, group in self.layers.values() for views, runs in plans
                  for pair in self.layout.copy_in_pairs(views[layer], blocks, runs[group])])
        return end - first_page


def _scale(by_tier: dict[str, int], kept: int, tokens: int) -> dict[str, int]:
    """About the first ``kept`` of ``tokens`` loaded tokens, by tier (split in the tiers' order)."""
    out: dict[str, int] = {}
    left = kept
    for tier, n in by_tier.items():
        if left <= 0:
            break
        out[tier] = min(n, left)
        left -= out[tier]
    return out
