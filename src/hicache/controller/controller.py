"""The cache controller: one task group, three supervised workers, bounded queues.

Workers:

* ``backup``: device -> host copies asked for by the write policy. Fed by a bounded stream, so a
  write-through ``store`` feels backpressure instead of queueing without limit; it batches every job
  waiting in the stream into one copy.
* ``load``: host -> device load-back for ``retrieve``, layer by layer; each layer's arrival wakes the
  callers waiting on it.
* ``eviction``: kicked when device usage crosses the high watermark; evicts down to the low one in
  the background so that most allocations find free pages.

Lifecycle (``async with controller``): open the pools, start the workers with a start-up handshake,
serve, then close the queues so the workers drain what is pending, bounded by ``shutdown_timeout_s``.
A worker that raises fails the cache: the error is recorded (every later call raises
``WorkerFailedError``) and propagates through the task group out of ``async with``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import CacheClosedError, CapacityError, WorkerFailedError
from ..io.transfer import TransferEngine
from ..policies.base import EvictionPolicy, WritePolicy
from ..radix_tree import HiRadixTree, Pin, TreeNode
from ..stats import Counters
from ..tiers.device import DevicePool
from ..tiers.host import HostPool
from .evictor import Evictor
from .jobs import BackupJob, JobTracker, LoadEntry, LoadJob

__all__ = ["CacheController"]

log = logging.getLogger(__name__)

_BACKUP_BATCH = 128  # jobs merged into one device -> host copy


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
        self.failure: WorkerFailedError | None = None
        self._open = False
        self._closed = False
        # Created on entry: anyio primitives need a running event loop.
        self.limiter: anyio.CapacityLimiter
        self.evictor: Evictor
        self.jobs: JobTracker
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
        self.evictor = Evictor(
            self.tree, self.device, self.host, self.engine, self.eviction_policy, self.write_policy,
            self.counters, self.limiter, on_device_alloc=self.kick_eviction,
            backups_in_flight=lambda: self.backup_jobs.count, wait_backups=self.backup_jobs.wait_idle,
        )
        backup_send, backup_recv = anyio.create_memory_object_stream[BackupJob](self.backup_queue)
        load_send, load_recv = anyio.create_memory_object_stream[LoadJob](self.load_queue)
        evict_send, evict_recv = anyio.create_memory_object_stream[None](1)
        self._backup_send, self._load_send, self._evict_send = backup_send, load_send, evict_send
        async with AsyncExitStack() as stack:
            await stack.enter_async_context(self.device)
            await stack.enter_async_context(self.host)
            async with anyio.create_task_group() as tg:
                await tg.start(self._supervise, "backup", self._backup_worker, backup_recv)
                await tg.start(self._supervise, "load", self._load_worker, load_recv)
                await tg.start(self._supervise, "eviction", self._eviction_worker, evict_recv)
                self._open = True
                try:
                    yield self
                finally:
                    self._open = False
                    # Closing the send sides lets each worker drain its queue and return;
                    # the deadline bounds how long pending backups may take.
                    backup_send.close()
                    load_send.close()
                    evict_send.close()
                    tg.cancel_scope.deadline = anyio.current_time() + self.shutdown_timeout_s

    async def _supervise(
        self,
        name: str,
        worker: Callable[[MemoryObjectReceiveStream], Awaitable[None]],
        receive: MemoryObjectReceiveStream,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        try:
            async with receive:
                await worker(receive)
        except Exception as exc:
            self.failure = WorkerFailedError(f"the {name} worker failed: {exc!r}")
            log.error("hicache %s worker failed; the cache is now unusable", name, exc_info=exc)
            raise self.failure from exc

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
            return {"backup": 0, "load": 0}
        return {
            "backup": self._backup_send.statistics().current_buffer_used,
            "load": self._load_send.statistics().current_buffer_used,
        }

    # -- backup (device -> host) ----------------------------------------------------------------

    def _backup_wanted(self, node: TreeNode) -> bool:
        return node.device is not None and node.host is None and not node.backing_up and node.loading is None

    def _new_backup_job(self, node: TreeNode) -> BackupJob:
        assert node.device is not None
        node.backing_up = True
        self.jobs.add()
        self.backup_jobs.add()
        return BackupJob(node, list(node.keys), list(node.device), Pin(node))

    def _finish_backup(self, job: BackupJob, host_pages: list[int] | None) -> None:
        for covered, start, end in self.tree.covering(job.node, job.keys):
            covered.backing_up = False
            if host_pages is not None:
                covered.host = host_pages[start:end]
        job.pin.release()
        self.backup_jobs.done()
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
            self._finish_backup(job, None)
            self.counters.backups_skipped += len(job.device_pages)
            return False
        except BaseException:
            self._finish_backup(job, None)
            raise
        return True

    async def _backup_worker(self, receive: MemoryObjectReceiveStream[BackupJob]) -> None:
        async for job in receive:
            batch = [job]
            while len(batch) < _BACKUP_BATCH:
                try:
                    batch.append(receive.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            await self._run_backups(batch)

    async def _run_backups(self, batch: list[BackupJob]) -> None:
        placed: list[tuple[BackupJob, list[int]]] = []
        try:
            for job in batch:
                try:
                    placed.append((job, self.evictor.alloc_host(len(job.device_pages))))
                except CapacityError:
                    self.counters.backups_skipped += len(job.device_pages)
            src = [p for job, _ in placed for p in job.device_pages]
            dst = [p for _, pages in placed for p in pages]
            if src:
                await anyio.to_thread.run_sync(self.engine.device_to_host, src, dst, limiter=self.limiter)
        except BaseException:
            for _, pages in placed:
                self.host.allocator.free(pages)
            for job in batch:
                self._finish_backup(job, None)
            raise
        done = {id(job) for job, _ in placed}
        for job, pages in placed:
            self._finish_backup(job, pages)
        for job in batch:
            if id(job) not in done:
                self._finish_backup(job, None)
        self.counters.backups += len(src)
        self.counters.bytes_moved["device_to_host"] += len(src) * self.device.geometry.page_bytes
        self.kick_eviction()  # backed-up pages may now be evicted for free

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
            Pin(pin_node),
        )
        offset = 0
        for nd in nodes:
            nd.device = device_pages[offset : offset + nd.num_pages]
            nd.loading = job
            offset += nd.num_pages
        self.jobs.add()
        try:
            # Shielded: other retrieves may already have joined this job (through node.loading),
            # so a cancelled submitter must not take it down with it. The wait is bounded by the
            # load worker draining its queue.
            with anyio.CancelScope(shield=True):
                await self._load_send.send(job)
        except BaseException as exc:  # the queue closed: the cache is shutting down
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
            job.finished.set()
            self.counters.loads += len(job.device_pages)
            self.counters.bytes_moved["host_to_device"] += len(job.device_pages) * self.device.geometry.page_bytes
        job.pin.release()
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
