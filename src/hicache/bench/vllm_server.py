"""``vllm serve`` processes for the serving benchmarks: start on loopback, wait, scrape, stop.

``VllmServer`` is one ``vllm serve`` process (the ``vllm`` command of this environment; its
OpenAI-compatible server) with its log in a file; with a connector configured it knows the
worker's channel (``engine_id`` in the transfer config, the runtime folder in the environment), so
a benchmark can ask the cache for its per-request load records and its counters. ``ServerSet`` is
what a benchmark drives: the servers it started and the one URL its clients send to (a server's
own, or a proxy in front of several: a prefill/decode pair behind ``hicache pd-proxy`` plugs in
here). Servers run one at a time on a small machine; each is stopped with SIGTERM (and killed if
it does not exit) before the next starts, whatever happened.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = ["ProxyProcess", "ServerSet", "VllmServer", "free_port", "vllm_command"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_command() -> str:
    """The ``vllm`` command beside this interpreter (the vLLM environment's), else the one on PATH."""
    beside = Path(sys.executable).with_name("vllm")
    return str(beside) if beside.exists() else "vllm"


def hicache_transfer(engine_id: str, extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a ``vllm serve`` with hicache's connector (``extra``: its
    ``kv_connector_extra_config``); a load that comes up short is recomputed."""
    return {
        "kv_connector": "HiCacheConnector",
        "kv_connector_module_path": "hicache.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra,
    }


@dataclass
class VllmServer:
    """One ``vllm serve`` process on ``127.0.0.1``; ``start()``, then ``stop()`` (or ``with``)."""

    name: str
    model: str
    args: list[str]  # vLLM's options after the model (``--kv-cache-memory-bytes ...``)
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # over this process's environment
    engine_id: str | None = None  # set with a connector: names the worker's channel
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 120.0
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    started_s: float = 0.0  # seconds the start took (to /health answering)
    _began: float = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [vllm_command(), "serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def start(self) -> VllmServer:
        """Start the process and wait until ``/health`` answers; ``RuntimeError`` with the log's tail if not."""
        self.launch()
        return self.wait_ready()

    def launch(self) -> VllmServer:
        """Start the process without waiting for it (``wait_ready`` waits): several servers then
        start side by side. Call from the thread that stops it: the child is signalled when the
        thread that started it ends (``PR_SET_PDEATHSIG``)."""
        self.port = self.port or free_port()
        env = dict(os.environ)
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it overrides --kv-cache-memory-bytes
        env.update(self.env)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self._began = time.monotonic()
        self.started_s = 0.0
        with open(self.log, "wb") as out:
            # Its own process group (stop() kills what vLLM leaves of it), and a SIGTERM to it if this
            # process dies without stopping it: a benchmark killed midway leaves no server running.
            self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=_term_with_parent)
        return self

    def wait_ready(self) -> VllmServer:
        """Wait until the launched server's ``/health`` answers (stopping it if it never does)."""
        assert self.proc is not None, "launch() first"
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name}: vllm serve exited ({self.proc.returncode}); log tail:\n{self.tail()}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5):
                        break
                except (urllib.error.URLError, OSError):
                    if time.monotonic() - self._began > self.start_timeout_s:
                        raise RuntimeError(f"{self.name}: not up after {self.start_timeout_s:.0f} s; log tail:\n"
                                           f"{self.tail()}") from None
                    time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        if not self.started_s:  # the first answer: a server waited for again later keeps its boot time
            self.started_s = time.monotonic() - self._began
        return self

    def kill(self) -> None:
        """SIGKILL the server's whole process group at once (a crash: nothing drains)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def get(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 300.0) -> dict[str, Any]:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read() or b"{}")

    def scrape(self) -> str:
        """The server's ``/metrics`` (vLLM's families, and hicache's when the connector runs)."""
        return self.get("/metrics")

    def channel_call(self, message: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any] | None:
        """Ask the connector's worker over its channel (None: no connector, or no answer). The
        channel lives in ``$HICACHE_VLLM_RUNTIME_DIR``: the server's environment must have this
        process's value (``env`` without it inherits it)."""
        if self.engine_id is None:
            return None
        from ..integrations.vllm.channel import ChannelClient, socket_path

        client = ChannelClient(socket_path(self.engine_id), timeout_s=timeout_s)
        try:
            return client.call(message)
        finally:
            client.close()

    def stop(self) -> int | None:
        """SIGTERM (vLLM drains, the connector writes what it owes storage), then SIGKILL after
        ``stop_timeout_s``; the exit status (None if it was not running)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the API server; it shuts its engine core and worker down in order
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        _signal_group(proc, signal.SIGKILL)  # what vLLM left behind in its group, if anything
        return proc.returncode

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _term_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the parent exits (``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class ProxyProcess:
    """``hicache pd-proxy`` in front of prefill and decode servers, as a process of its own (the
    command a user runs: ``python -m hicache.cli pd-proxy`` of this interpreter), on loopback."""

    prefill: list[str]
    decode: list[str]
    log: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    start_timeout_s: float = 60.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ProxyProcess:
        self.port = self.port or free_port()
        cmd = [sys.executable, "-m", "hicache.cli", "pd-proxy", "--prefill", ",".join(self.prefill),
               "--decode", ",".join(self.decode), "--host", "127.0.0.1", "--port", str(self.port)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_term_with_parent)
        began = time.monotonic()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"pd-proxy exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5):
                        return self
                except (urllib.error.URLError, OSError):
                    if time.monotonic() - began > self.start_timeout_s:
                        raise RuntimeError(f"pd-proxy not up after {self.start_timeout_s:.0f} s") from None
                    time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def health(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/health", timeout=10) as resp:
            return json.loads(resp.read())

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass
class ServerSet:
    """The servers one configuration runs and the URL its clients send to (``url``: the first
    server's unless a proxy in front of them is given). ``with ServerSet(...)`` starts them in
    order and stops them all, in reverse, however the block ends."""

    servers: list[VllmServer]
    proxy_url: str | None = None
    side_by_side: bool = False  # start the servers at once (a prefill/decode pair), not one after the other
    proxy: ProxyProcess | None = None  # started once the servers are up, stopped first

    @property
    def url(self) -> str:
        if self.proxy is not None:
            return self.proxy.url
        return self.proxy_url or self.servers[0].url

    @property
    def model(self) -> str:
        return self.servers[0].model

    def __enter__(self) -> ServerSet:
        started: list[VllmServer] = []
        try:
            if self.side_by_side:
                for server in self.servers:
                    started.append(server.launch())
                for server in self.servers:
                    server.wait_ready()
            else:
                for server in self.servers:  # one launched beforehand (booted beside others) is waited for
                    started.append(server.wait_ready() if server.proc is not None else server.start())
            if self.proxy is not None:
                self.proxy.start()
        except BaseException:
            for server in reversed(started):
                server.stop()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for server in reversed(self.servers):
            server.stop()
