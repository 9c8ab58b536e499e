"""The cache controller: one task group, three supervised workers, bounded queues.

Workers:

* ``backup``: device -> host copies asked for by the write policy. Fed by a bounded stream, so a
  write-through ``store`` feels backpressure instead of queueing without limit; it batches every job
  waiting in the stream into one copy a round. A node larger than the host room it can get is
  copied by runs (split), each run's storage write queued before the next run needs its room, so
  a host tier smaller than one prompt still carries every page down to storage.
* ``load``: host -> device load-back for ``retrieve``, layer by layer; each layer's arrival wakes the
  callers waiting on it.
* ``eviction``: kicked when device usage crosses the high watermark; evicts down to the low one in
  the background so that most allocations find free pages.
* ``storage`` (with storage tiers, started at open or with the first ``attach_storage``): host ->
  storage writes asked for by the write policy, fed by a bounded stream that the backup worker and
  ``store`` feed (backpressure again), batched per tier.

Prefetches from storage run as tasks of the same group (``prefetch.py``). Failures of a storage
backend are misses and counted errors (``StorageTier``); any other error in a worker or a prefetch
is a bug and fails the cache like a worker failure.

Lifecycle (``async with controller``): open the pools, start the workers with a start-up handshake,
serve, then cancel prefetches and close the queues so the workers drain what is pending (backups
first, then the storage writes they queued), bounded by ``shutdown_timeout_s``.
A worker that raises fails the cache: the error is recorded (every later call raises
``WorkerFailedError``) and propagates through the task group out of ``async with``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import CacheClosedError, WorkerFailedError
from ..io.transfer import TransferEngine
from ..keys import TokenBytes
from ..policies.base import EvictionPolicy, WritePolicy
from ..policies.prefetch import PrefetchPolicy, Timeout
from ..radix_tree import HiRadixTree, Pin, TreeNode
from ..stats import Counters
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from ..tiers.storage.tier import StorageTier
from .evictor import Evictor
from .jobs import BackupJob, JobTracker, LoadEntry, LoadJob, StorageJob
from .placement import Placed, Placement
from .prefetch import Prefetcher
from .residency import Residency
from .storage_chain import StorageChain, StorageChange
from .storage_writer import StorageWriter

__all__ = ["CacheController"]

log = logging.getLogger(__name__)

T = TypeVar("T")

_BACKUP_BATCH = 128  # jobs merged into one device -> host copy
_STORAGE_BATCH = 64  # jobs merged into one host -> storage write per tier


class CacheController(anyio.AsyncContextManagerMixin):
    """Owns the tiers, the index, the data plane and the background workers."""

    def __init__(
        self,
        *,
        tree: HiRadixTree,
        device: DevicePool,
        host: HostPool,
        engine: TransferEngine,
        eviction_policy: EvictionPolicy,
        write_policy: WritePolicy,
        io_threads: int = 2,
        backup_queue: int = 64,
        load_queue: int = 64,
        high_watermark: float = 0.95,
        low_watermark: float = 0.85,
        shutdown_timeout_s: float = 10.0,
        layerwise: bool = True,
        storage: Sequence[StorageTier] = (),
        prefetch_policy: PrefetchPolicy | None = None,
        prefetch_threshold_tokens: int = 256,
        storage_queue: int = 64,
        max_prefetches: int = 4,
        alloc_wait_s: float = 30.0,
        writes_storage: bool = True,
        window_slack_pages: int = 0,
        sliding_layers: Sequence[int] = (),
        checkpoints: bool = False,
    ) -> None:
        self.tree = tree
        self.device = device
        self.host = host
        self.engine = engine
        self.eviction_policy = eviction_policy
        self.write_policy = write_policy
        self.counters = Counters()
        self.io_threads = io_threads
        self.backup_queue = backup_queue
        self.load_queue = load_queue
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.shutdown_timeout_s = shutdown_timeout_s
        self.layerwise = layerwise
        self.storage = list(storage)
        self.prefetch_policy = prefetch_policy or Timeout()
        self.prefetch_threshold_tokens = prefetch_threshold_tokens
        self.storage_queue = storage_queue
        self.max_prefetches = max_prefetches
        self.alloc_wait_s = alloc_wait_s
        self.sliding_layers = tuple(sliding_layers)  # a store fills the window of pages held thin
        self.window_slack_pages = window_slack_pages  # policies.window_slack_tokens, in pages
        self.checkpoints = checkpoints  # a recurrent model: pages are whole only at checkpoints
        self.storage_writer = StorageWriter(
            tree, self.storage, self.counters, device.geometry.page_bytes, slack_pages=window_slack_pages,
            checkpoints=checkpoints,
        )
        # Reads the live list: storage tiers come and go (attach_storage / detach_storage).
        # writes_storage=False: a rank whose shared pages another rank writes (Namespace.writes_storage).
        self.residency = Residency(
            write_policy, has_host=host.num_pages > 0, storage=self.storage, writes_storage=writes_storage
        )
        self.failure: WorkerFailedError | None = None
        # Set by an engine that knows when it computes (CachedCausalLM: its ComputeGate's
        # wait_no_prefill): backups and storage writes wait for it, at most yield_max_s each time,
        # so they run between prefills and batch what queued meanwhile. Load-backs, prefetches
        # and spills never wait: a request is waiting for them.
        self.yield_to_compute: Callable[[], Awaitable[None]] | None = None
        self.yield_max_s = 1.0
        self._open = False
        self._closed = False
        # Created on entry: anyio primitives need a running event loop.
        self.limiter: anyio.CapacityLimiter
        self.evictor: Evictor
        self.placement: Placement
        self.prefetcher: Prefetcher
        self.chain: StorageChain
        self.jobs: JobTracker
        self._task_group: anyio.abc.TaskGroup
        self._storage_send: MemoryObjectSendStream[StorageJob] | None = None
        self._stack: AsyncExitStack
        self._backup_send: MemoryObjectSendStream[BackupJob]
        self._load_send: MemoryObjectSendStream[LoadJob]
        self._evict_send: MemoryObjectSendStream[None]

    # -- lifecycle ------------------------------------------------------------------------------

    @asynccontextmanager
    async def __asynccontextmanager__(self) -> AsyncGenerator[CacheController]:
        if self._open or self._closed:
            # Reopening would hand out pages of a buffer that was freed at close.
            raise CacheClosedError("a cache can be entered once; build a new one with HiCache.from_config")
        self._closed = True
        self.limiter = anyio.CapacityLimiter(self.io_threads)
        self.jobs = JobTracker()
        self.backup_jobs = JobTracker()
        self.storage_jobs = JobTracker()
        # Jobs whose end can let a page leave a tier: what an allocation may wait for.
        self.frees_device = JobTracker()  # backups, load-backs, stores publishing
        self.frees_host = JobTracker()  # storage writes, load-backs, stores publishing
        self.evictor = Evictor(
            self.tree, self.device, self.host, self.engine, self.eviction_policy, self.residency,
            self.counters, self.limiter, frees_device=self.frees_device, frees_host=self.frees_host,
            alloc_wait_s=self.alloc_wait_s,
            on_device_alloc=self.kick_eviction,
            storage_writer=self.storage_writer,  # used only while a storage tier is attached
            on_host_copy=lambda node: self.host_copy_made(node, wait=False),
            shed_keep=self.tree.window_pages + self.window_slack_pages if self.tree.window_pages else None,
        )
        self.placement = Placement(
            tree=self.tree, device=self.device, host=self.host, engine=self.engine, evictor=self.evictor,
            counters=self.counters, limiter=self.limiter, frees_device=self.frees_device, frees_host=self.frees_host,
            kick_eviction=self.kick_eviction, sliding_layers=self.sliding_layers, checkpoints=self.checkpoints,
        )
        self.prefetcher = Prefetcher(
            tree=self.tree, tiers=self.storage, policy=self.prefetch_policy,
            threshold_tokens=self.prefetch_threshold_tokens, max_concurrent=self.max_prefetches,
            alloc_host=lambda n: self.evictor.alloc_host(n, partial=True), free_host=self.host.allocator.free,
            insert_host=lambda tb, first, pages, whole=None: self.placement.insert_pages(
                tb, first, [], pages, whole=whole
            ).nodes,
            check_open=self.check_open,
            spawn=lambda run: self._task_group.start_soon(self._guard, "prefetch", run),
            counters=self.counters, jobs=self.jobs, page_bytes=self.device.geometry.page_bytes,
            pin_room=self.evictor.wait_pin_room, slack_pages=self.window_slack_pages, shed_host=self.host.shed,
            checkpoints=self.checkpoints,
        )
        self.chain = StorageChain(
            self.storage, host=self.host, tree=self.tree, writer=self.storage_writer, prefetcher=self.prefetcher,
            storage_jobs=self.storage_jobs, check_open=self.check_open, start_storage_worker=self.ensure_storage_worker,
            close_with_cache=self.close_with_cache, default_timeout_s=self.shutdown_timeout_s,
        )
        backup_send, backup_recv = anyio.create_memory_object_stream[BackupJob](self.backup_queue)
        load_send, load_recv = anyio.create_memory_object_stream[LoadJob](self.load_queue)
        evict_send, evict_recv = anyio.create_memory_object_stream[None](1)
        self._backup_send, self._load_send, self._evict_send = backup_send, load_send, evict_send
        if self.storage:
            self._storage_send, storage_recv = anyio.create_memory_object_stream[StorageJob](self.storage_queue)
        async with AsyncExitStack() as stack:
            self._stack = stack
            # Closed however the block ends, also when a tier fails to open before the workers start.
            for stream in (backup_send, backup_recv, load_send, load_recv, evict_send, evict_recv):
                stack.callback(stream.close)
            if self._storage_send is not None:
                stack.callback(self._storage_send.close)
                stack.callback(storage_recv.close)
            await stack.enter_async_context(self.device)
            await stack.enter_async_context(self.host)
            for tier in self.storage:
                await stack.enter_async_context(tier)
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                await tg.start(self._supervise, "backup", self._backup_worker, backup_recv)
                await tg.start(self._supervise, "load", self._load_worker, load_recv)
                await tg.start(self._supervise, "eviction", self._eviction_worker, evict_recv)
                if self.storage:
                    await tg.start(self._supervise, "storage", self._storage_worker, storage_recv)
                self._open = True
                try:
                    yield self
                finally:
                    self._open = False
                    deadline = anyio.current_time() + self.shutdown_timeout_s
                    self.prefetcher.cancel_all()
                    if self.failure is None:
                        await self._drain_down(deadline)
                    # Closing the send sides lets each worker drain its queue and return (the
                    # backup worker closes the storage queue when it is done, since its backups
                    # feed it); the deadline bounds how long pending writes may take.
                    backup_send.close()
                    load_send.close()
                    evict_send.close()
                    tg.cancel_scope.deadline = deadline
            self._count_unwritten()

    async def _drain_down(self, deadline: float) -> None:
        """Shutdown: write what the write policy promised to storage, within the deadline.

        Memory is about to go: device pages owed to storage get host copies (their storage write
        follows under write-through), then every host page still owed is written. Shielded, so a
        cancelled caller still drains, and bounded by ``shutdown_timeout_s``.
        """
        if not self.storage:
            return
        with anyio.CancelScope(shield=True, deadline=deadline):
            # A spill in flight (the eviction worker's) makes its host copy only when its round
            # ends: wait for it, else its node looks device-only and is never written.
            await self.evictor.settle()
            for node in list(self.tree.nodes()):
                if node.device is not None and node.host is None and self.residency.owed_below(node):
                    await self.submit_backup(node)
            await self.backup_jobs.wait_idle()
            for node in list(self.tree.nodes()):
                if self.residency.owed_below(node) and self.storage_writer.wanted(node):
                    await self.submit_storage_backup(node)
            await self.storage_jobs.wait_idle()

    def _count_unwritten(self) -> None:
        """After the workers stopped: pages owed to storage that never got there are lost; say so once."""
        if not self.storage:
            return
        lost = self.counters.lost_pages
        device = host = 0
        for node in self.tree.nodes():
            if self.residency.owed_below(node):
                if node.host is None:
                    device += node.num_pages
                else:
                    host += node.num_pages
        lost["device"] += device
        lost["host"] += host
        if device or host:
            log.warning(
                "hicache closed with %d pages the %s policy promised to storage not written there "
                "(%d never reached the host, %d failed or ran out of shutdown_timeout_s=%.1fs)",
                device + host, self.residency.write_policy.name, device, host, self.shutdown_timeout_s,
            )

    async def _supervise(
        self,
        name: str,
        worker: Callable[[MemoryObjectReceiveStream], Awaitable[None]],
        receive: MemoryObjectReceiveStream,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        await self._guard(name, lambda: self._drain(worker, receive))

    @staticmethod
    async def _drain(
        worker: Callable[[MemoryObjectReceiveStream], Awaitable[None]], receive: MemoryObjectReceiveStream
    ) -> None:
        async with receive:
            await worker(receive)

    async def _guard(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        """Run a background task; an error fails the cache instead of vanishing with the task."""
        try:
            await run()
        except Exception as exc:
            self.failure = self.failure or WorkerFailedError(f"the {name} worker failed: {exc!r}")
            log.error("hicache %s worker failed; the cache is now unusable", name, exc_info=exc)
            raise self.failure from exc

    # -- the storage chain at runtime (storage_chain.py) ------------------------------------------

    async def attach_storage(self, tier: StorageTier, position: int | None = None) -> StorageChange:
        self.check_open()  # the chain exists while the cache is open
        return await self.chain.attach(tier, position)

    async def detach_storage(self, name: str, *, drain: bool = True, timeout_s: float | None = None) -> StorageChange:
        self.check_open()
        return await self.chain.detach(name, drain=drain, timeout_s=timeout_s)

    async def ensure_storage_worker(self) -> None:
        """Start the storage worker and its queue if no storage tier was configured at start."""
        if self._storage_send is not None:
            return
        send, receive = anyio.create_memory_object_stream[StorageJob](self.storage_queue)
        self._storage_send = send
        self._stack.callback(send.close)
        self._stack.callback(receive.close)
        await self._task_group.start(self._supervise, "storage", self._storage_worker, receive)

    def close_with_cache(self, tier: StorageTier) -> None:
        """Close ``tier`` when the cache closes, after the workers (a no-op if detached by then)."""
        self._stack.push_async_exit(tier)

    def check_open(self) -> None:
        if self.failure is not None:
            raise self.failure
        if not self._open:
            raise CacheClosedError("the cache is not open: use `async with HiCache.from_config(...) as cache`")

    async def wait_idle(self) -> None:
        """Wait until every queued backup, load-back and watermark eviction has finished."""
        self.check_open()
        await self.jobs.wait_idle()

    def queue_depths(self) -> dict[str, int]:
        if not hasattr(self, "_backup_send"):
            return {"backup": 0, "load": 0, "storage": 0, "prefetch": 0}
        storage = self._storage_send
        return {
            "backup": self._backup_send.statistics().current_buffer_used,
            "load": self._load_send.statistics().current_buffer_used,
            "storage": storage.statistics().current_buffer_used if storage is not None else 0,
            # list(): a copy made at once, so a scrape from another thread never sees the dict change
            "prefetch": len({id(op) for op in list(self.prefetcher.running.values())}),
        }

    # -- backup (device -> host) ----------------------------------------------------------------

    def _backup_wanted(self, node: TreeNode) -> bool:
        return node.device is not None and node.host is None and not node.backing_up and node.loading is None

    def _new_backup_job(self, node: TreeNode) -> BackupJob:
        assert node.device is not None
        node.backing_up = True
        self.jobs.add()
        self.backup_jobs.add()
        self.frees_device.add()
        return BackupJob(node, list(node.keys), list(node.device), Pin(node, job=True))

    def _finish_backup(self, job: BackupJob) -> None:
        """End the job: its runs have their host pages already; what was not copied stays owed."""
        for covered, _, _ in self.tree.covering(job.node, job.keys):
            covered.backing_up = False
        job.pin.release()
        self.backup_jobs.done()
        self.frees_device.done()
        self.jobs.done()

    async def submit_backup(self, node: TreeNode, *, wait: bool = True) -> bool:
        """Queue a backup of ``node``; with ``wait=False`` drop it when the queue is full."""
        if not self._backup_wanted(node):
            return False
        job = self._new_backup_job(node)
        try:
            if wait:
                await self._backup_send.send(job)
            else:
                self._backup_send.send_nowait(job)
        except anyio.WouldBlock:
            self._finish_backup(job)
            self.counters.backups_skipped += len(job.device_pages)
            return False
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            self._finish_backup(job)
            raise self._stopped() from exc
        except BaseException:
            self._finish_backup(job)
            raise
        return True

    def _stopped(self) -> WorkerFailedError | CacheClosedError:
        """What a call finding a worker's queue closed raises: never an anyio type."""
        return self.failure or CacheClosedError("the cache is closing: no new background work is accepted")

    async def _yield_to_compute(self) -> None:
        """Let the engine's prefill finish first (bounded; not while shutting down)."""
        wait = self.yield_to_compute
        if wait is not None and self._open:
            with anyio.move_on_after(self.yield_max_s):
                await wait()

    async def _backup_worker(self, receive: MemoryObjectReceiveStream[BackupJob]) -> None:
        try:
            async for job in receive:
                try:
                    await self._yield_to_compute()
                except BaseException:
                    self._finish_backup(job)  # cancelled while waiting: the job ends here
                    raise
                await self._run_backups(_with_queued(job, receive, _BACKUP_BATCH))
        finally:
            if self._storage_send is not None:
                self._storage_send.close()  # no more backups: the storage worker may drain and stop

    async def _run_backups(self, batch: list[BackupJob]) -> None:
        """Copy the jobs' device pages to the host in rounds, one run per job and round, one copy a round.

        A job gets the host pages it can have (``alloc_host(partial=True)``, which evicts and waits
        as any allocation does); when that is fewer than it has left, the run it got is split off
        as a node of its own (``_split_run``), copied, and its storage write queued. Under a policy
        that owes the pages to storage, the next round's allocation can then drop that run from the
        host once written, so a node larger than the whole host tier still reaches storage run by
        run. Without storage below, a short run ends the job: cycling the host would only copy
        pages the next run drops again (the rest is spilled at device eviction, by runs too).
        A job that gets no host page ends; what it did not copy is counted in ``backups_skipped``.
        """
        left = list(batch)
        try:
            while left:
                runs, left = await self._backup_round(left)
                # Queueing may wait, and the tree may change meanwhile (a node evicted by then is no
                # longer wanted, which host_copy_made checks).
                for node in runs:
                    await self.host_copy_made(node)
        except BaseException:
            for job in left:
                self._finish_backup(job)
            raise

    async def _backup_round(self, jobs: list[BackupJob]) -> tuple[list[TreeNode], list[BackupJob]]:
        """One run of each job; returns the nodes that got host pages and the jobs to go on with."""
        placed: list[tuple[BackupJob, list[int]]] = []
        try:
            for job in jobs:
                pages = await self.evictor.alloc_host(len(job.keys) - job.done, partial=True)
                if pages:
                    placed.append((job, pages))
            # No await from here to the copy: the runs' nodes cannot be split under us.
            src = [p for job, pages in placed for node in self._split_run(job, len(pages)) for p in node.device or ()]
            dst = [p for _, pages in placed for p in pages]
            if src:
                # From here on it waits for nothing but the copy: an allocation of host pages may wait for it.
                with self.frees_host.running():
                    await anyio.to_thread.run_sync(self.engine.device_to_host, src, dst, limiter=self.limiter)
        except BaseException:
            for _, pages in placed:
                self.host.allocator.free(pages)
            raise
        runs: list[TreeNode] = []
        got = {id(job) for job, _ in placed}
        for job, pages in placed:
            first = job.done
            job.done += len(pages)
            for covered, start, end in self.tree.covering(job.node, job.keys):
                if first <= start and end <= job.done:  # splits since the copy only add boundaries
                    covered.host = pages[start - first : end - first]
                    covered.backing_up = False
                    runs.append(covered)
        self.counters.backups += len(src)
        self.counters.bytes_moved["device_to_host"] += len(src) * self.device.geometry.page_bytes
        self.kick_eviction()  # backed-up pages may now be evicted for free
        going_on: list[BackupJob] = []
        for job in jobs:
            rest = len(job.keys) - job.done
            if rest and id(job) in got and self.residency.owed_below(job.node):
                going_on.append(job)  # the next run goes through the host once this one is written
                continue
            self.counters.backups_skipped += rest
            self._finish_backup(job)
        runs.reverse()  # covering lists deepest first: queue the writes prefix first
        return runs, going_on

    def _split_run(self, job: BackupJob, pages: int) -> list[TreeNode]:
        """The nodes holding the job's next ``pages`` pages, prefix first; the last one is split
        so that the run ends on a node boundary (the job's pages after it stay owed)."""
        first, end = job.done, job.done + pages
        out: list[TreeNode] = []
        for covered, start, stop in reversed(self.tree.covering(job.node, job.keys)):
            if stop <= first or start >= end:
                continue
            assert start >= first, "a backup run starts on a node boundary (the last run's end)"
            if stop > end:
                covered = self.tree.split(covered, end - start)  # the prefix: the run's last part
            out.append(covered)
        return out

    # -- new pages: where they go (placement.py), which copies they are owed (residency.py) ------

    async def store(
        self, tb: TokenBytes, kv: Any, *, start: int, priority: int, whole: frozenset[int] | None = None
    ) -> Placed:
        """Place a store's new pages, then queue the copies down they are owed: ``HiCache.store``."""
        placed = await self.placement.store(tb, kv, start=start, priority=priority, whole=whole)
        await self.owe_copies(placed.nodes)
        return placed

    async def commit(
        self, tb: TokenBytes, first_page: int, pages: list[int], priority: int, *, on_host: bool = False,
        whole: frozenset[int] | None = None,
    ) -> Placed:
        """Publish a reservation's pages (``on_host``: host pages), then queue the copies they are
        owed: ``SlotReservation.commit``."""
        placed = await self.placement.commit(tb, first_page, pages, priority, on_host=on_host, whole=whole)
        await self.owe_copies(placed.nodes)
        return placed

    async def owe_copies(self, nodes: Iterable[TreeNode], *, hit: bool = False, wait: bool = True) -> None:
        """Queue the copies down that ``nodes`` are owed now, as the residency rule says: right
        after they were stored, or (``hit``) after a retrieve hit them. A device-only node may be
        owed its host copy (its storage write follows that copy); a node with host pages its
        storage write. ``wait=False``: skip a copy whose queue is full (a retrieve never waits)."""
        for node in nodes:
            if self.residency.host_copy_due(node, hit=hit):
                await self.submit_backup(node, wait=wait)  # its storage write follows the host copy
            else:
                await self.host_copy_made(node, wait=wait)

    # -- storage (host -> storage) --------------------------------------------------------------

    async def host_copy_made(self, node: TreeNode, *, wait: bool = True) -> None:
        """A node has host pages (stored there, copied down, spilled): queue their storage write
        if the residency rule says it is owed now."""
        if self.storage_writer.wanted(node) and self.residency.storage_copy_due(node):
            await self.submit_storage_backup(node, wait=wait)

    async def submit_storage_backup(self, node: TreeNode, *, wait: bool = True) -> bool:
        """Queue a write of ``node``'s host pages to storage; with ``wait=False`` skip it when full.

        Nothing is written where the residency rule says storage is owed nothing (another rank writes it).
        """
        if self._storage_send is None or not self.residency.owes_storage or not self.storage_writer.wanted(node):
            return False
        job = self.storage_writer.prepare(node)
        self.jobs.add()
        self.storage_jobs.add()
        self.frees_host.add()
        try:
            if wait:
                await self._storage_send.send(job)
            else:
                self._storage_send.send_nowait(job)
        except (anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._finish_storage(job, None)  # full, or shutting down: the pages stay owed
            return False
        except BaseException:
            self._finish_storage(job, None)
            raise
        return True

    def _finish_storage(self, job: StorageJob, stored: bool | None) -> None:
        self.storage_writer.finish(job, stored)
        self.storage_jobs.done()
        self.frees_host.done()
        self.jobs.done()

    async def _storage_worker(self, receive: MemoryObjectReceiveStream[StorageJob]) -> None:
        async for job in receive:
            try:
                await self._yield_to_compute()
            except BaseException:
                self._finish_storage(job, None)  # cancelled while waiting: the pages stay owed
                raise
            batch = _with_queued(job, receive, _STORAGE_BATCH)
            results: list[bool | None] = [None] * len(batch)  # None: cut off by the shutdown deadline
            try:
                results = await self.storage_writer.write(batch)
            finally:
                for one, ok in zip(batch, results, strict=True):
                    self._finish_storage(one, ok)

    # -- load-back (host -> device) -------------------------------------------------------------

    async def submit_load(self, nodes: list[TreeNode], device_pages: list[int], pin_node: TreeNode) -> LoadJob:
        """Queue a load of host-only ``nodes`` into ``device_pages`` (already allocated).

        The nodes count as device-resident from now on (``node.loading`` is set until the data has
        arrived), so concurrent retrieves share this job instead of loading twice.
        """
        host_pages = [p for nd in nodes for p in (nd.host or [])]
        assert len(host_pages) == len(device_pages)
        job = LoadJob(
            [LoadEntry(nd, list(nd.keys)) for nd in nodes],
            host_pages,
            device_pages,
            self.device.geometry.num_layers,
            Pin(pin_node, job=True),
        )
        offset = 0
        for nd in nodes:
            nd.device = device_pages[offset : offset + nd.num_pages]
            nd.loading = job
            offset += nd.num_pages
        self.jobs.add()
        self.frees_device.add()
        self.frees_host.add()
        try:
            # Shielded: other retrieves may already have joined this job (through node.loading),
            # so a cancelled submitter must not take it down with it. The wait is bounded by the
            # load worker draining its queue.
            with anyio.CancelScope(shield=True):
                await self._load_send.send(job)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            error = self._stopped()
            self._finish_load(job, error)
            raise error from exc
        except BaseException as exc:
            self._finish_load(job, CacheClosedError(f"load-back not started: {exc!r}"))
            raise
        return job

    def _finish_load(self, job: LoadJob, error: BaseException | None) -> None:
        for entry in job.entries:
            for covered, _, _ in self.tree.covering(entry.node, entry.keys):
                covered.loading = None
                if error is not None:
                    # The device pages never got their data: the node is host-only again.
                    covered.device = None
        if error is not None:
            self.device.allocator.free(job.device_pages)
            job.fail(error)
        else:
            for layer in range(job.num_layers):
                job.layer_arrived(layer)  # idempotent; covers callbacks not yet run
            job.succeeded()
            self.counters.loads += len(job.device_pages)
            self.counters.bytes_moved["host_to_device"] += len(job.device_pages) * self.device.geometry.page_bytes
        job.pin.release()
        self.frees_device.done()
        self.frees_host.done()
        self.jobs.done()
        self.kick_eviction()

    async def _load_worker(self, receive: MemoryObjectReceiveStream[LoadJob]) -> None:
        loop = asyncio.get_running_loop()
        async for job in receive:

            def on_layer(layer: int, job: LoadJob = job) -> None:
                loop.call_soon_threadsafe(job.layer_arrived, layer)

            try:
                await anyio.to_thread.run_sync(
                    self.engine.host_to_device, job.host_pages, job.device_pages, on_layer, self.layerwise,
                    limiter=self.limiter,
                )
                # Let the layer callbacks queued by the thread run before declaring the job done.
                await anyio.lowlevel.checkpoint()
            except BaseException as exc:
                self._finish_load(job, exc)
                raise
            self._finish_load(job, None)

    # -- watermark eviction ---------------------------------------------------------------------

    def kick_eviction(self) -> None:
        """Wake the eviction worker if the device is above its high watermark."""
        if self.device.num_pages and self.device.used_pages > self.high_watermark * self.device.num_pages:
            try:
                self._evict_send.send_nowait(None)
            except (anyio.WouldBlock, anyio.ClosedResourceError):
                return  # already kicked, or shutting down
            self.jobs.add()

    async def _eviction_worker(self, receive: MemoryObjectReceiveStream[None]) -> None:
        async for _ in receive:
            try:
                target = int(self.low_watermark * self.device.num_pages)
                excess = self.device.used_pages - target
                if excess > 0:
                    await self.evictor.evict_device(excess)
            finally:
                self.jobs.done()


def _with_queued(first: T, receive: MemoryObjectReceiveStream[T], limit: int) -> list[T]:
    """``first`` and whatever else is already queued, up to ``limit`` jobs: one batch."""
    batch = [first]
    while len(batch) < limit:
        try:
            batch.append(receive.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return batch
