"""``kind: nixl-peer`` against strangers, hostile peers and slow ones (issue #50, items 1, 4 and 5).

Real producers and consumers (real NIXL agents, real sockets on loopback); a stranger is a plain
socket speaking the wire protocol without the secret. Fakes only where a peer must misbehave: a
producer that drips its answer or cannot prove the secret (``FakeProducer``), a relay that turns a
real producer's answer into a drip (``DrippingProxy``), and an ``accept`` starved of file
descriptors (a subprocess under a low ``RLIMIT_NOFILE``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from hicache.errors import ConfigError, StorageError
from hicache.keys import TenantKey
from hicache.tiers.storage.nixl import peer_auth
from hicache.tiers.storage.nixl import peer_wire as wire
from hicache.tiers.storage.nixl.agent import nixl_available
from hicache.tiers.storage.nixl.peer_arena import PageArena

from .fakes import DrippingProxy, FakeProducer
from .servers import unavailable
from .test_storage_backends import PAGE, empty, key, page

REPO = Path(__file__).resolve().parent.parent
TOKEN = "peer-token-for-the-tests-0123456789"


@pytest.fixture
def nixl() -> None:
    why = nixl_available()
    if why is not None:
        unavailable(why)


def _peer(**options: object):  # noqa: ANN202 - the backend class is imported with NIXL present only
    from hicache.tiers.storage.nixl.peer import NixlPeerBackend

    return NixlPeerBackend(**options)


def _stranger(address: tuple[str, int], op: bytes, body: bytes = b"") -> bytes:
    """Send one frame without authenticating; everything the producer sends back until it closes
    (or 2 s pass)."""
    with socket.create_connection(address, timeout=2) as sock:
        try:
            wire.send_frame(sock, op, body, time.monotonic() + 2)
        except OSError:
            return b""
        got = b""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            got += chunk
        return got


def _authenticated(address: tuple[str, int], token: str = TOKEN) -> peer_auth.Channel:
    sock = socket.create_connection(address, timeout=2)
    channel, _ = peer_auth.client_handshake(sock, peer_auth.peer_key(token, None)[0], time.monotonic() + 5)
    return channel


def _ask(channel: peer_auth.Channel, op: bytes, body: bytes) -> bytes:
    channel.send(op, body, time.monotonic() + 5)
    got, answer = channel.recv(time.monotonic() + 5)
    assert got == wire.OK, answer
    return answer


# -- item 1: authenticate before anything is revealed --------------------------------------------------


async def test_a_stranger_learns_nothing_and_changes_nothing(nixl: None) -> None:
    """Without the secret: HELLO, LOCATE, RELEASE and DELETE get no answer but a refusal (never the
    agent metadata, never a page's place), and the pages and leases stay as they were."""
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN) as producer:
        assert producer.address is not None and producer._arena is not None
        await producer.set([key(i) for i in range(3)], [page(i) for i in range(3)])
        metadata = producer._server.hello
        keys = wire.encode_keys([key(0), key(1), key(2)], lease=True)
        for op, body in [(wire.HELLO, b""), (wire.LOCATE, keys), (wire.RELEASE, (1).to_bytes(8, "little")),
                         (wire.DELETE, keys)]:
            got = _stranger(producer.address, op, body)
            assert metadata[-64:] not in got and wire.OK not in got[4:5], (op, got[:80])
        # AUTH with a made-up proof: the challenge, then a refusal.
        with socket.create_connection(producer.address, timeout=2) as sock:
            deadline = time.monotonic() + 2
            wire.send_frame(sock, wire.AUTH, wire.MAGIC + os.urandom(32), deadline)
            op, challenge = wire.recv_frame(sock, deadline)
            assert op == wire.OK and len(challenge) == len(wire.MAGIC) + 32
            wire.send_frame(sock, wire.HELLO, os.urandom(16), deadline)
            assert wire.recv_frame(sock, deadline) == (wire.ERROR, b"not authenticated")
        assert producer._arena.count([key(0), key(1), key(2)]) == 3 and producer._arena.leases() == 0


async def test_a_wrong_secret_is_refused_either_way(nixl: None) -> None:
    """A consumer with another token (or tenant key) is refused by the producer; a consumer facing a
    producer that cannot prove the secret (an impostor) refuses it. The right secret, given as
    ``peer_token`` or derived from the tenant key, is served."""
    tenant = TenantKey("tenant-key-of-the-tests-0123456789")
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN) as by_token, \
            _peer(listen="127.0.0.1:0", tenant_key=tenant) as by_tenant:
        for producer in (by_token, by_tenant):
            await producer.set([key(0)], [page(0)])
        token_at = f"127.0.0.1:{by_token.address[1]}"
        tenant_at = f"127.0.0.1:{by_tenant.address[1]}"
        async with _peer(peers=[token_at], peer_token=TOKEN) as good, \
                _peer(peers=[tenant_at], tenant_key=tenant) as good_tenant:
            assert await good.exists([key(0)]) == 1 and await good_tenant.exists([key(0)]) == 1
        for wrong in ({"peer_token": TOKEN[::-1]}, {"tenant_key": tenant}, {}):
            async with _peer(peers=[token_at], **wrong) as bad:
                with pytest.raises(StorageError, match="refused"):
                    await bad.exists([key(0)])
        async with _peer(peers=[tenant_at], tenant_key=TenantKey("another-tenant-key-0123456789")) as bad:
            with pytest.raises(StorageError, match="refused"):
                await bad.exists([key(0)])
    impostor = FakeProducer("impostor")
    try:
        async with _peer(peers=[f"127.0.0.1:{impostor.port}"], peer_token=TOKEN) as consumer:
            with pytest.raises(StorageError, match="MAC does not match"):
                await consumer.exists([key(0)])
    finally:
        impostor.stop()


async def test_an_authenticated_peer_can_still_write_the_arena(nixl: None) -> None:
    """The documented limit (docs/engines/pd.md, docs/security.md): NIXL registers the arena for
    remote READ and WRITE alike (its UCX plugin maps memory with UCX's default protection, and its
    API takes no access flags), so a peer holding the secret can rewrite a page over UCX. What stops
    that page being served is the tier's check: a tenant key's MAC. If this starts failing, NIXL
    gained a read-only registration: use it, and update the docs."""
    import numpy as np

    from hicache.tiers.storage.nixl.agent import NixlAgent, pair

    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN) as producer:
        assert producer.address is not None and producer._arena is not None
        await producer.set([key(0)], [page(0)])
        channel = _authenticated(producer.address)
        metadata, address, _ = wire.decode_hello(_ask(channel, wire.HELLO, b""))
        _, (located,) = wire.decode_located(_ask(channel, wire.LOCATE, wire.encode_keys([key(0)])), 2**40, 1)
        agent = NixlAgent("test", {"UCX": {}}, progress_thread=True)
        try:
            name = agent.add_remote(metadata)
            offset, length = located.spans[0]
            junk = np.full(length, 42, dtype=np.uint8)
            registration = agent.register([(junk.ctypes.data, length, 0)], "DRAM")
            rows_l, rows_r = pair([(junk.ctypes.data, length, 0)], [(address + offset, length, 0)])
            agent.run("WRITE", rows_l, rows_r, name, deadline_s=10)
            agent.deregister(registration)
            agent.remove_remote(name)
        finally:
            agent.close()
            channel.sock.close()
        assert bytes(producer._arena.buffer[offset : offset + length]) == bytes(junk)


def test_no_listening_or_asking_beyond_loopback_without_a_secret() -> None:
    from hicache import HiCache

    from .conftest import make_config

    for options in ({"listen": "0.0.0.0:7400"}, {"listen": "[::]:7400"}, {"peers": ["127.0.0.1:1", "10.0.0.5:7400"]},
                    {"listen": "prefill-0.internal:7400"}):
        with pytest.raises(ConfigError, match="not loopback"):
            _peer(**options)
    assert _peer(listen="0.0.0.0:7400", peer_token=TOKEN).settings.listen  # built, not opened
    assert _peer(peers=["10.0.0.5:7400"], tenant_key=TenantKey("tenant-key-of-the-tests-0123456789"))
    for options in ({"listen": "127.0.0.1:0"}, {"listen": "localhost:0"}, {"peers": ["[::1]:7400"]}):
        assert _peer(**options)
    # Through the composition root: the config's tenant key is the secret.
    storage = {"storage": [{"kind": "nixl-peer", "listen": "0.0.0.0:0"}]}
    HiCache.from_config(make_config(8, 16, tiers=storage, tenant_key="tenant-key-of-the-tests-0123456789"))
    with pytest.raises(ConfigError, match="not loopback"):
        HiCache.from_config(make_config(8, 16, tiers=storage))


async def test_a_cache_built_producer_derives_its_secret_from_the_tenant_key(nixl: None) -> None:
    """Through the composition root (``HiCache.from_config``): the config's ``tenant_key`` is the
    secret of a producer without ``peer_token``; a consumer with the same tenant key is served, one
    without any secret is refused."""
    from hicache import HiCache

    from .conftest import make_config

    tenant = "tenant-key-of-the-tests-0123456789"
    config = make_config(8, 16, tenant_key=tenant, tiers={"storage": [{"kind": "nixl-peer", "listen": "127.0.0.1:0"}]})
    async with HiCache.from_config(config) as cache:
        producer = next(t.backend for t in cache.controller.storage if t.name == "nixl-peer")
        assert producer.address is not None
        at = [f"127.0.0.1:{producer.address[1]}"]
        async with _peer(peers=at, tenant_key=TenantKey(tenant)) as good, _peer(peers=at) as stranger:
            assert await good.exists([key(0)]) == 0  # authenticated: an answer (it has no such page)
            with pytest.raises(StorageError, match="refused"):
                await stranger.exists([key(0)])


def test_the_peer_token_is_a_secret_never_shown() -> None:
    from hicache.containers import storage_entry

    entry = storage_entry({"kind": "nixl-peer", "listen": "127.0.0.1:0", "peer_token": TOKEN})
    assert TOKEN not in repr(entry) and TOKEN not in str(entry.model_dump())
    assert TOKEN not in repr(_peer(listen="127.0.0.1:0", peer_token=TOKEN).settings)
    with pytest.raises(ConfigError) as short:
        storage_entry({"kind": "nixl-peer", "listen": "127.0.0.1:0", "peer_token": "short-secret"})
    assert "short-secret" not in str(short.value) and "16 characters" in str(short.value)
    assert _peer(listen="127.0.0.1:0", peer_token="").settings.peer_token is None  # ${VAR:-} unset


# -- item 4: the control plane ---------------------------------------------------------------------


def test_duplicate_keys_are_held_once_and_leases_are_capped() -> None:
    arena = PageArena(8 * PAGE, lease_s=30, lease_share=0.5, leases_per_owner=4)
    assert arena.store([key(i) for i in range(8)], [page(i) for i in range(8)]) == 8
    lease, found = arena.locate([key(0)] * 4096, lease=True, owner=1)
    assert lease and len(found) == 4096 and arena.pinned == PAGE  # answered as asked, held once
    for owner in range(1, 50):
        for _ in range(5):  # one more than an owner may hold
            arena.locate([key(i) for i in range(8)] * 512, lease=True, owner=owner)
    assert arena.pinned <= 4 * PAGE and arena.leases_of(1) <= 4 and arena.revoked > 0
    assert arena.store([key(100 + i) for i in range(8)], [page(100 + i) for i in range(8)]) >= 4
    mine, _ = arena.locate([key(100)], lease=True, owner=500)
    arena.release(mine, owner=501)  # another owner's id: ignored
    assert arena.leases_of(500) == 1
    arena.end_owner(500)
    assert arena.leases_of(500) == 0


async def test_a_stranger_renewing_leases_cannot_stop_the_producer_storing(nixl: None) -> None:
    """The issue's attack (leases of 4,096 references each, never released, left the producer
    storing 0 pages): a stranger gets no lease at all, and an authenticated peer doing the same
    holds at most ``lease_share`` of the arena; releasing another connection's lease does nothing."""
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN, capacity=8 * PAGE, lease_s=600) as producer:
        assert producer.address is not None and producer._arena is not None
        await producer.set([key(i) for i in range(8)], [page(i) for i in range(8)])
        many = wire.encode_keys([key(i) for i in range(8)] * 512, lease=True)
        for _ in range(20):
            _stranger(producer.address, wire.LOCATE, many)
        assert await producer.set([key(20 + i) for i in range(8)], [page(20 + i) for i in range(8)]) == 8
        channel = _authenticated(producer.address)
        first, _ = wire.decode_located(_ask(channel, wire.LOCATE, wire.encode_keys([key(20)], lease=True)),
                                       8 * PAGE, 1)
        other = _authenticated(producer.address)
        _ask(other, wire.RELEASE, first.to_bytes(8, "little"))
        assert producer._arena.leases() == 1  # not its lease: still held
        for _ in range(40):
            _ask(other, wire.LOCATE, wire.encode_keys([key(20 + i) for i in range(8)] * 512, lease=True))
        assert producer._arena.pinned <= 4 * PAGE
        assert await producer.set([key(40 + i) for i in range(8)], [page(40 + i) for i in range(8)]) >= 4
        other.sock.close()
        channel.sock.close()


async def test_idle_unauthenticated_sockets_are_dropped_and_a_consumer_is_served(nixl: None) -> None:
    """More silent sockets than ``max_clients``: a consumer is still served at once (it takes the
    place of the oldest), and every silent socket is closed within ``auth_timeout_s``."""
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN, max_clients=4, auth_timeout_s=0.5) as producer:
        assert producer.address is not None
        await producer.set([key(0)], [page(0)])
        idle = [socket.create_connection(producer.address, timeout=3) for _ in range(8)]
        try:
            await anyio.sleep(0.1)
            started = time.monotonic()
            async with _peer(peers=[f"127.0.0.1:{producer.address[1]}"], peer_token=TOKEN) as consumer:
                assert await consumer.exists([key(0)]) == 1
                assert time.monotonic() - started < 2
                for sock in idle:  # closed by the producer: EOF (or a reset) within the bound
                    try:
                        assert sock.recv(1) == b""
                    except ConnectionResetError:
                        pass
                assert time.monotonic() - started < 3
                assert producer._server.connections() == (1, 1)
        finally:
            for sock in idle:
                sock.close()


async def test_idle_consumers_do_not_starve_a_new_one(nixl: None) -> None:
    """``max_clients`` consumers connected and idle: a new one takes the longest idle one's place,
    and that one reconnects when it next asks."""
    from hicache.tiers.storage.nixl.peer_server import MIN_IDLE_S

    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN, max_clients=2) as producer:
        assert producer.address is not None
        await producer.set([key(0)], [page(0)])
        at = [f"127.0.0.1:{producer.address[1]}"]
        async with _peer(peers=at, peer_token=TOKEN) as a, _peer(peers=at, peer_token=TOKEN) as b, \
                _peer(peers=at, peer_token=TOKEN) as c:
            assert await a.exists([key(0)]) == 1 and await b.exists([key(0)]) == 1
            await anyio.sleep(MIN_IDLE_S + 0.2)
            assert await c.exists([key(0)]) == 1
            assert await a.exists([key(0)]) == 1  # its connection was closed: made again, quietly
            assert a.stats().errors == 0


def test_the_accept_loop_survives_running_out_of_file_descriptors(tmp_path: Path) -> None:
    """A fault: the producer's process runs out of file descriptors (``RLIMIT_NOFILE`` just above
    what it has open), so ``accept`` fails with EMFILE while connections queue. It logs that a few
    times at most, backs off, and serves again once descriptors are free."""
    script = tmp_path / "producer.py"
    script.write_text(
        "import logging, os, resource, sys\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from hicache.tiers.storage.nixl import peer_auth\n"
        "from hicache.tiers.storage.nixl.peer_arena import PageArena\n"
        "from hicache.tiers.storage.nixl.peer_server import PeerServer\n"
        f"key, _ = peer_auth.peer_key({TOKEN!r}, None)\n"
        "server = PeerServer(PageArena(2**20, 30), b'hello', '127.0.0.1', 0, key=key, max_clients=64, idle_s=30,\n"
        "                    auth_timeout_s=0.5)\n"
        "n = len(os.listdir('/proc/self/fd'))\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "print(server.address[1], flush=True)\n"
        "sys.stdin.read()\n"
        "print(server.accept_errors, flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        line = proc.stdout.readline()
        assert line.strip(), proc.stderr.read() if proc.stderr else ""
        address = ("127.0.0.1", int(line))
        flood = [socket.create_connection(address, timeout=2) for _ in range(12)]
        time.sleep(0.5)  # accept fails (EMFILE) meanwhile
        for sock in flood:
            sock.close()
        started = time.monotonic()
        while True:  # descriptors come free as the flood's sockets are read to their end
            try:
                channel = _authenticated(address)
                break
            except (OSError, wire.WireError):
                assert time.monotonic() - started < 8, "the producer never served again"
                time.sleep(0.2)
        assert _ask(channel, wire.HELLO, b"") == b"hello"
        channel.sock.close()
        out, err = proc.communicate(input="", timeout=10)
        assert int(out.strip()) >= 1  # it did run out, and survived
        assert err.count("accept failed") <= 3, err[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- item 5: a consumer's calls are bounded ----------------------------------------------------------


@pytest.mark.parametrize("verb", ["exists", "get"])
async def test_a_dripping_producer_is_a_miss_within_timeout_s(nixl: None, verb: str) -> None:
    """A producer that drips its first answer one byte at a time (the issue's held a get for 44 s
    against ``timeout_s: 2``): the call fails within ``timeout_s``, with no thread left reading the
    drip, then its pages are plain misses."""
    fake = FakeProducer("drip")
    try:
        async with _peer(peers=[f"127.0.0.1:{fake.port}"], timeout_s=1.0, connect_timeout_s=5.0) as consumer:
            started = time.monotonic()
            with pytest.raises(StorageError):
                await (consumer.exists([key(0)]) if verb == "exists" else consumer.get([key(0)], empty(1)))
            assert time.monotonic() - started < 2.0
            await anyio.sleep(0.2)
            assert _threads_in_the_backend() == 0
            assert await consumer.get([key(0)], empty(1)) == 0  # down for retry_s: not asked
    finally:
        fake.stop()


async def test_a_producer_dripping_mid_exchange_is_a_miss_within_timeout_s(nixl: None) -> None:
    """Authenticated and connected for real, then the producer's answer to a LOCATE drips."""
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN) as producer:
        assert producer.address is not None
        await producer.set([key(0)], [page(0)])
        proxy = DrippingProxy(producer.address)
        try:
            async with _peer(peers=[f"127.0.0.1:{proxy.port}"], peer_token=TOKEN, timeout_s=1.0) as consumer:
                started = time.monotonic()
                with pytest.raises(StorageError):
                    await consumer.get([key(0)], empty(1))
                assert proxy.dripped == 1 and time.monotonic() - started < 2.0
                assert await consumer.get([key(0)], empty(1)) == 0
        finally:
            proxy.stop()


async def test_a_cancelled_get_and_aclose_return_at_once_with_a_large_frame_in_flight(nixl: None) -> None:
    """``timeout_s`` long, a 8 MiB answer dripping: a get cancelled by its caller returns at once,
    and ``aclose`` with another get still reading returns at once too (that get then fails)."""
    async with _peer(listen="127.0.0.1:0", peer_token=TOKEN) as producer:
        assert producer.address is not None
        await producer.set([key(0)], [page(0)])
        proxy = DrippingProxy(producer.address)
        consumer = _peer(peers=[f"127.0.0.1:{proxy.port}"], peer_token=TOKEN, timeout_s=30.0)
        closed_in: list[float] = []
        failed: list[BaseException] = []
        try:
            await consumer.open()
            started = time.monotonic()
            with anyio.move_on_after(0.5):
                await consumer.get([key(0)], empty(1))
            assert time.monotonic() - started < 2.0

            async def reading() -> None:
                try:
                    await consumer.get([key(0)], empty(1))
                except StorageError as exc:
                    failed.append(exc)

            async def closing() -> None:
                while proxy.dripped < 2:
                    await anyio.sleep(0.02)
                t = time.monotonic()
                await consumer.aclose()
                closed_in.append(time.monotonic() - t)

            async with anyio.create_task_group() as tg:
                tg.start_soon(reading)
                tg.start_soon(closing)
                with anyio.move_on_after(3):  # then the drip is stopped, so old code ends too
                    while not closed_in or not failed:
                        await anyio.sleep(0.02)
                proxy.stop()
            assert closed_in and closed_in[0] < 2.0 and failed
        finally:
            proxy.stop()
            await consumer.aclose()


def _threads_in_the_backend() -> int:
    """Threads whose stack is inside ``tiers/storage/nixl`` now (a call blocked or running there)."""
    inside = 0
    for frame in sys._current_frames().values():
        f = frame
        while f is not None:
            if "tiers/storage/nixl/" in f.f_code.co_filename.replace(os.sep, "/"):
                inside += 1
                break
            f = f.f_back
    return inside


async def test_cancelled_exists_calls_leave_no_thread_behind(nixl: None) -> None:
    """Twenty ``exists`` calls against a dripping producer, each cancelled by its caller: no worker
    thread stays blocked on the connection's lock or socket (the issue's leaked one each)."""
    fake = FakeProducer("drip")
    try:
        async with _peer(peers=[f"127.0.0.1:{fake.port}"], timeout_s=30.0, connect_timeout_s=30.0) as consumer:
            async def one() -> None:
                with anyio.move_on_after(0.3):
                    await consumer.exists([key(0)])

            async with anyio.create_task_group() as tg:
                for _ in range(20):
                    tg.start_soon(one)
            deadline = time.monotonic() + 2.0
            while _threads_in_the_backend() and time.monotonic() < deadline:
                await anyio.sleep(0.02)
            assert _threads_in_the_backend() == 0
    finally:
        fake.stop()
