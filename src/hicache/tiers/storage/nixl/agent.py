"""One NIXL agent per backend: the import, memory registration, and transfers waited on with a deadline.

Everything here blocks and runs in the backend's worker thread, one call at a time (the agent is
created without NIXL's own locking). A transfer is described as two ``N x 3`` arrays of
``(address, length, device id)`` rows, local and remote, row ``i`` of one moving to or from row
``i`` of the other; ``pair`` cuts two lists of buffers into such rows, so a page whose header and
payload pieces differ in number and size from the regions on the other side still moves in one
request, each byte once.

**Registration.** NIXL moves only registered memory. Buffers handed in by the tier (a host pool's
pages, a batch's header array) are registered for the one call and deregistered after it: for the
POSIX plugin and for UCX over shared memory this is book-keeping (measured here, 256 buffers at a
time: ~1 us a buffer for POSIX, ~5 us for UCX, against milliseconds to move a batch). On an RDMA NIC
registering pins memory, and registering the host pool once (as ``kind: mooncake`` does) is the
step to take there.

**Deadlines.** ``run`` polls the transfer until it is done, failed, or ``deadline_s`` passed; then
it releases the request, which asks the plugin to cancel it. The thread is never abandoned while a
transfer may still write into the caller's memory.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ....errors import StorageBackendError

__all__ = ["NixlAgent", "Region", "TransferFailed", "address_of", "import_nixl", "nixl_available", "pair", "regions_of"]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'hicache[nixl]' (NIXL's PyPI wheel: `pip install nixl`)"


class TransferFailed(RuntimeError):
    """A NIXL transfer ended in an error (a short read, a dead peer) or did not finish in time."""


def _skip_ib_without_rdma() -> None:
    """Keep UCX from loading its InfiniBand module on a machine with no RDMA device.

    With the system's ``libibverbs1`` installed (Mooncake needs it), the wheel's UCX ib module pulls
    in the system's verbs providers and with them a second copy of ``libnl-route``, whose destructor
    crashes the process at exit (SIGSEGV in ``rtnl_tc_unregister``, after everything else is done):
    measured with two processes on loopback here. Without an RDMA device the module has nothing to
    drive, so ``UCX_MODULES=^ib`` costs nothing; an explicit ``UCX_MODULES`` is left as it is.
    """
    if "UCX_MODULES" in os.environ:
        return
    try:
        has_rdma = any(os.scandir("/sys/class/infiniband"))
    except OSError:
        has_rdma = False
    if not has_rdma:
        os.environ["UCX_MODULES"] = "^ib"


def import_nixl(kind: str) -> Any:
    """``nixl._api``, or ``StorageBackendError`` saying how to install it."""
    _skip_ib_without_rdma()
    try:
        from nixl import _api  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or OSError for a missing shared library
        raise StorageBackendError(kind, "open", f"cannot import nixl ({exc}); {INSTALL_HINT}") from exc
    # NIXL configures its Python logger to print INFO lines ("Initialized NIXL agent") to stdout,
    # which would land in every command's output; its warnings and errors still print.
    nixl_log = logging.getLogger("nixl")
    if nixl_log.level == logging.INFO:
        nixl_log.setLevel(logging.WARNING)
    return _api


def nixl_available() -> str | None:
    """``None`` when NIXL imports, else why not (for tests and benchmarks)."""
    try:
        import_nixl("nixl")
    except StorageBackendError as exc:
        return str(exc)
    return None


def address_of(buf: memoryview) -> int:
    """The address of a contiguous buffer, writable or not, without copying it."""
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data) if len(buf) else 0


Region = tuple[int, int, int]  # (address or file offset, length, device id or file descriptor)


def regions_of(buffers: Sequence[memoryview], size: int | None = None) -> list[Region]:
    """DRAM regions of ``buffers`` in order; with ``size``, only their first ``size`` bytes."""
    out: list[Region] = []
    left = sum(len(b) for b in buffers) if size is None else size
    for buf in buffers:
        if left <= 0:
            break
        n = min(len(buf), left)
        if n:
            out.append((address_of(buf), n, 0))
        left -= n
    return out


def pair(local: Sequence[Region], remote: Sequence[Region]) -> tuple[np.ndarray, np.ndarray]:
    """Cut two runs of regions of equal total length into matching ``N x 3`` descriptor rows.

    Row ``i`` of both results has the same length: byte ``k`` of the local run moves to or from
    byte ``k`` of the remote run, whatever the two sides' pieces are.
    """
    out_l: list[Region] = []
    out_r: list[Region] = []
    li = ri = lo = ro = 0  # lo / ro: bytes already used of local[li] / remote[ri]
    while li < len(local) and ri < len(remote):
        (la, ln, ld), (ra, rn, rd) = local[li], remote[ri]
        n = min(ln - lo, rn - ro)
        if n > 0:
            out_l.append((la + lo, n, ld))
            out_r.append((ra + ro, n, rd))
        lo, ro = lo + n, ro + n
        if lo >= ln:
            li, lo = li + 1, 0
        if ro >= rn:
            ri, ro = ri + 1, 0
    if li < len(local) or ri < len(remote):
        raise ValueError("the two sides of a transfer differ in length")
    return np.array(out_l, dtype=np.uint64).reshape(-1, 3), np.array(out_r, dtype=np.uint64).reshape(-1, 3)


#: Microseconds NIXL's progress thread sleeps between rounds. NIXL's Python API sets 0, and the
#: thread then spins: a whole core per agent for as long as it is open, which here also halved a
#: loopback READ (2.1-2.2 GB/s against 4.7-6.1 with 1000 us, producer CPU 9.6 s against 0.2 s over
#: 12 s; over TCP 1.1-1.2 GB/s either way). Transfers this process starts are progressed by its own
#: polls (``run``); the thread serves the other side's (connection set-up, TCP's emulated reads).
PROGRESS_DELAY_US = 1000
#: The least time ``run`` waits for a request it gave up on to be cancelled (even with no time left
#: of its own deadline: the caller's memory may still be written until then).
RELEASE_WAIT_S = 1.0
_construct = threading.Lock()


def _new_agent(api: Any, name: str, config: Any, progress_delay_us: int) -> Any:
    """``nixl_agent(name, config)`` with the progress thread's delay set (the wrapper hard-codes 0):
    its binding's constructor is wrapped for the one call, under a lock."""
    bindings = api.nixlBind
    with _construct:
        real = bindings.nixlAgent

        def with_delay(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = progress_delay_us
            return real(agent_name, agent_config)

        bindings.nixlAgent = with_delay
        try:
            return api.nixl_agent(name, config)
        finally:
            bindings.nixlAgent = real


class NixlAgent:
    """A NIXL agent with the given plugins; blocking, one caller at a time (see the module docstring)."""

    def __init__(self, kind: str, plugins: dict[str, dict[str, str]], *, progress_thread: bool) -> None:
        api = import_nixl(kind)
        self.kind = kind
        self.name = f"hicache-{kind}-{secrets.token_hex(6)}"
        config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=[])
        self._api = api
        self.agent = _new_agent(api, self.name, config, PROGRESS_DELAY_US)
        available = self.agent.get_plugin_list()
        for plugin, params in plugins.items():
            if plugin not in available:
                raise StorageBackendError(kind, "open", f"NIXL has no {plugin} plugin here (it has {', '.join(available)})")
            self.agent.create_backend(plugin, params)
        self.plugins = list(plugins)

    # -- registration -----------------------------------------------------------------------------

    def register(self, regions: Sequence[Region], mem: str) -> Any:
        """Register ``(address or offset, length, device or fd)`` regions; returns what ``deregister`` takes."""
        if not regions:
            return None
        return self.agent.register_memory([(a, n, d, "") for a, n, d in regions], mem, backends=self.plugins)

    def deregister(self, handle: Any) -> None:
        if handle is not None:
            try:
                self.agent.deregister_memory(handle, backends=self.plugins)
            except Exception as exc:  # noqa: BLE001 - leaking a registration is not worth failing a call
                log.warning("%s: NIXL deregistration failed: %s", self.kind, exc)

    # -- transfers --------------------------------------------------------------------------------

    def run(
        self, op: str, local: np.ndarray, remote: np.ndarray, remote_agent: str | bytes, *, local_mem: str = "DRAM",
        remote_mem: str = "DRAM", deadline_s: float, stop: threading.Event | None = None,
    ) -> None:
        """Move ``local`` rows to (``WRITE``) or from (``READ``) ``remote`` rows; ``TransferFailed`` if
        the transfer errs, is not done within ``deadline_s``, or ``stop`` is set first (the caller
        was cancelled). Either way it returns only once the request is released (cancelled)."""
        if not len(local):
            return
        agent = self.agent
        try:
            handle = agent.initialize_xfer(
                op, agent.get_xfer_descs(local, local_mem), agent.get_xfer_descs(remote, remote_mem), remote_agent,
                backends=self.plugins,
            )
        except Exception as exc:
            raise TransferFailed(f"{op} could not be set up: {type(exc).__name__}: {exc}") from exc
        state = "ERR"
        deadline = time.monotonic() + deadline_s
        try:
            state = agent.transfer(handle)
            pause = 0.0
            while state == "PROC":
                if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                    break
                time.sleep(pause)  # a yield first, then up to 1 ms: the plugin's threads do the work
                pause = min(0.001, pause * 2 or 0.00002)
                state = agent.check_xfer_state(handle)
        except Exception as exc:  # the plugin reports a failed transfer by raising (a short read, a peer gone)
            state = f"ERR ({type(exc).__name__}: {exc})"
        finally:
            self._release(handle, max(deadline_s, RELEASE_WAIT_S))
        if state != "DONE":
            why = f"not done within {deadline_s}s" if state == "PROC" else state
            raise TransferFailed(f"{op} of {len(local)} regions: {why}")

    def _release(self, handle: Any, deadline_s: float) -> None:
        """Release the request; one still in flight is cancelled by the plugin, or waited for."""
        end = time.monotonic() + deadline_s
        while True:
            try:
                handle.release()
                return
            except Exception as exc:  # noqa: BLE001 - the plugin could not cancel it yet
                if time.monotonic() > end:
                    # Nothing more can be done from here; NIXL keeps the handle in its leak list.
                    log.error("%s: a NIXL transfer could not be cancelled (%s)", self.kind, exc)
                    return
                try:
                    if self.agent.check_xfer_state(handle) != "PROC":
                        continue
                except Exception:  # noqa: BLE001 - failed: releasing it next is what we want
                    continue
                time.sleep(0.001)

    # -- metadata (UCX peers) -----------------------------------------------------------------------

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, metadata: bytes) -> str:
        name = self.agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except Exception as exc:  # noqa: BLE001 - already gone
            log.debug("%s: removing remote agent %s: %s", self.kind, name, exc)

    def close(self) -> None:
        """Drop the agent (NIXL frees it when the last reference goes)."""
        self.agent = None
