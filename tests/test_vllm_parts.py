"""The vLLM connector's parts that need no vLLM: the block<->page copies, the config it derives
from vLLM's model config, and the side channel to the worker (a real socket, a real cache).

The end-to-end tests with vLLM itself are in tests/vllm (run in .venv-vllm by `make test`)."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from anyio.from_thread import start_blocking_portal

from hicache import ConfigError, UnsupportedModelError, load_config
from hicache.integrations.vllm import channel
from hicache.integrations.vllm.channel import ChannelClient, encode, pack_tokens, socket_path, unpack_tokens
from hicache.integrations.vllm.export import decode
from hicache.integrations.vllm.export import encode as encode_families
from hicache.integrations.vllm.gil import DEFAULT_SWITCH_INTERVAL_S, shortened_switch_interval
from hicache.integrations.vllm.layout import BlockLayout, copy_all
from hicache.integrations.vllm.service import CacheService
from hicache.integrations.vllm.settings import cache_config_for, connector_options, weights_fingerprint

from .conftest import make_kv, make_tokens

# -- layout ----------------------------------------------------------------------------------------


def _token_kv(kv: torch.Tensor, block: int, offset: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one token slot, read the way vLLM's CPU attention reads its layer (K rows, then V rows)."""
    rows = kv.view(kv.shape[0], kv.shape[1], 2 * bs, -1)  # [num_blocks, H, 2 * block_size, D]
    return rows[block, :, offset], rows[block, :, bs + offset]


def _tier(kind: str, page_size: int, heads: int, dim: int, pages: int, layers: int = 3,
          dtype: torch.dtype = torch.float32) -> Any:
    """A real memory tier of ``pages`` pages (host page-first, host layer-first or the device pool), open."""
    from hicache.tiers.base import KVGeometry
    from hicache.tiers.device import DevicePool
    from hicache.tiers.host import HostPool

    geo = KVGeometry(2, layers, page_size, heads, dim, dtype)
    tier = DevicePool(geo, pages * geo.page_bytes, "cpu") if kind == "device" else HostPool(
        geo, pages * geo.page_bytes, layout=kind, pin_memory=False)
    tier._buffer = tier._allocate_buffer()
    tier.buffer.zero_()
    return tier


# The copies view both sides as integer words: int64 (fp32, dim 8), int32 (bf16, dim 2: a 4-byte row)
# and int16 (fp16, dim 3: a 6-byte row); a word never straddles two heads' rows.
@pytest.mark.parametrize(("dtype", "dim"), [(torch.float32, 8), (torch.bfloat16, 2), (torch.float16, 3)])
@pytest.mark.parametrize("page_size", [128, 32])
@pytest.mark.parametrize("kind", ["page_first", "layer_first", "device"])
def test_pages_saved_from_vllm_blocks_hold_each_tokens_k_and_v_and_load_back_bit_exact(
    page_size: int, kind: str, dtype: torch.dtype, dim: int
) -> None:
    bs, heads, nb, layer = 128, 3, 9, 1
    layout = BlockLayout(block_size=bs, page_size=page_size, num_kv_heads=heads, head_dim=dim)
    gen = torch.Generator().manual_seed(0)
    vllm_layer = torch.randn((nb, heads, bs, 2 * dim), generator=gen).to(dtype)
    layout.check_layer("model.layers.0.self_attn.attn", vllm_layer)
    block_ids = [2, 3, 7]  # the request's blocks, in token order: a run of two, then one apart
    num_pages = 3 * bs // page_size
    tier = _tier(kind, page_size, heads, dim, 10 + num_pages, dtype=dtype)
    # The first two blocks' pages consecutive, the last block's backwards: runs are found where both
    # sides are consecutive (one per block when a block holds several pages).
    two = 2 * bs // page_size
    tier_pages = list(range(10, 10 + two)) + list(range(10 + two, 10 + num_pages))[::-1]
    runs = layout.runs(block_ids, 0, tier_pages)
    assert sum(r.length for r in runs) == num_pages and len(runs) < num_pages
    copy_all(layout.copy_out_runs(layout.blocks_view(vllm_layer), layout.pages_view(tier.layer_view(layer)), runs))
    pool = tier.layer_view(layer).unflatten(2, (page_size, heads, dim))  # [pages, C, ps, H, D]
    for t in (0, 1, page_size - 1, page_size, bs + 5, 2 * bs + 3, 3 * bs - 1):
        k, v = _token_kv(vllm_layer, block_ids[t // bs], t % bs, bs)
        page, off = tier_pages[t // page_size], t % page_size
        assert torch.equal(pool[page, 0, off], k) and torch.equal(pool[page, 1, off], v)
    assert not tier.layer_view(0).any() and not tier.layer_view(2).any()  # other layers untouched
    # Load pages of blocks 1.. of the request back into fresh blocks: exactly their slots change.
    target = torch.zeros_like(vllm_layer)
    first = bs // page_size  # from the second block on
    later = layout.runs(block_ids, first, tier_pages[first:])
    copy_all(layout.copy_in_runs(layout.pages_view(tier.layer_view(layer)), layout.blocks_view(target), later))
    assert torch.equal(target[block_ids[1]], vllm_layer[block_ids[1]])
    assert torch.equal(target[block_ids[2]], vllm_layer[block_ids[2]])
    assert not target[block_ids[0]].any() and not target[0].any()
    # The same load as page-by-page pairs in one call (what a hand-off's receive does): the same blocks.
    again = torch.zeros_like(vllm_layer)
    copy_all(layout.copy_in_pairs(layout.pages_view(tier.layer_view(layer)), layout.blocks_view(again), later))
    assert torch.equal(again, target)
    # Run by run in one call for every layer (what a step's load and save do): the same blocks and pages.
    layers = [vllm_layer, torch.randn((nb, heads, bs, 2 * dim), generator=gen).to(dtype)]
    both = _tier(kind, page_size, heads, dim, 10 + num_pages, dtype=dtype)
    copy_all([pair for i, kv in enumerate(layers) for pair in layout.copy_out_runs(
        layout.blocks_view(kv), layout.pages_view(both.layer_view(i)), runs)])
    assert torch.equal(both.layer_view(0), tier.layer_view(layer))  # the same pages as the one-layer save
    for i, kv in enumerate(layers):
        fresh = torch.zeros_like(kv)
        copy_all(layout.copy_in_runs(layout.pages_view(both.layer_view(i)), layout.blocks_view(fresh), runs))
        assert all(torch.equal(fresh[b], kv[b]) for b in block_ids) and not fresh[0].any()


def test_a_page_size_that_does_not_divide_the_block_size_or_a_foreign_layout_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="must divide"):
        BlockLayout(block_size=128, page_size=48, num_kv_heads=2, head_dim=8)
    layout = BlockLayout(block_size=128, page_size=64, num_kv_heads=2, head_dim=8)
    with pytest.raises(UnsupportedModelError, match="expected a contiguous"):
        layout.check_layer("x", torch.zeros((4, 2, 2, 128, 8)))  # another backend's [blocks, 2, ...] layout


# -- settings --------------------------------------------------------------------------------------


def _vllm_config(model: str, *, block_size: int = 128, mla: bool = False, revision: str | None = None) -> Any:
    mc = SimpleNamespace(
        model=model, revision=revision, dtype=torch.float32, quantization=None, use_mla=mla, is_hybrid=False,
        is_attention_free=False, max_model_len=1024,
        hf_text_config=SimpleNamespace(num_hidden_layers=4), get_num_layers=lambda pc: 4, get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 8, get_total_num_kv_heads=lambda: 2,
    )
    return SimpleNamespace(
        model_config=mc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=512),
    )


def test_the_namespace_comes_from_vllms_model_config_and_the_weights_fingerprint(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights v1")
    cfg = cache_config_for(_vllm_config(str(model)), {"overrides": {"tiers": {"host": {"capacity": "8MiB"}}}})
    m = cfg.model
    assert (m.name, m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (str(model), 4, 2, 8, "float32")
    assert m.revision == f"xxh3-128:{weights_fingerprint(model)}"
    assert cfg.page_size == 128  # follows vLLM's block size
    # With a host tier the connector copies to host pages directly: the device tier is one block.
    assert cfg.tiers.device.capacity == cfg.page_bytes
    # Without one the pages live on the device tier: max_model_len + max_num_batched_tokens tokens of it.
    hostless = cache_config_for(_vllm_config(str(model)), {"overrides": {"tiers": {"host": {"capacity": 0}}}})
    assert hostless.tiers.device.capacity == (1024 + 512) // 128 * cfg.page_bytes
    (model / "model.safetensors").write_bytes(b"weights v2")
    assert cache_config_for(_vllm_config(str(model))).model.revision != m.revision  # other weights, other keys
    pinned = cache_config_for(_vllm_config(str(model)), {"overrides": {"model": {"revision": "release-7"}}})
    assert pinned.model.revision == "release-7"
    assert cache_config_for(_vllm_config("org/hub-model", revision="abc123")).model.revision == "abc123"


def test_a_decode_server_without_a_tenant_key_warns_that_clients_can_make_hand_off_parameters(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def config(role: str, **overrides: Any) -> Any:
        vc = _vllm_config(str(tmp_path))
        vc.kv_transfer_config = SimpleNamespace(kv_role=role)
        return cache_config_for(vc, {"overrides": overrides})

    with caplog.at_level("WARNING", logger="vllm.hicache"):
        config("kv_consumer")
    assert any("kv_transfer_params from whoever reaches" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm.hicache"):
        config("kv_consumer", tenant_key="a-tenant-key-0123456789")
        config("kv_producer")
    assert not any("kv_transfer_params" in r.getMessage() for r in caplog.records)


def test_page_size_extra_keys_and_unsupported_models_are_checked(tmp_path: Path) -> None:
    vc = _vllm_config(str(tmp_path))
    assert cache_config_for(vc, {"overrides": {"page_size": 32}}).page_size == 32
    with pytest.raises(ConfigError, match="must divide"):
        cache_config_for(vc, {"overrides": {"page_size": 48}})
    with pytest.raises(ConfigError, match="unknown key"):
        cache_config_for(vc, {"confg": "x.yaml"})
    with pytest.raises(UnsupportedModelError, match="MLA"):
        cache_config_for(_vllm_config(str(tmp_path), mla=True))


def test_a_sliding_window_layout_is_read_and_stored_whole_with_the_hybrid_manager_off(tmp_path: Path) -> None:
    """Gemma 3's layout from vLLM's HF text config. With vLLM's hybrid KV cache manager on (the
    default for this connector: a block table per layer kind, blocks behind the window freed) the
    storage tier keeps sliding layers near prefix ends only; with it off vLLM keeps every token's
    KV in blocks it serves again, so storage keeps pages whole."""
    vc = _vllm_config(str(tmp_path))
    kinds = ["sliding_attention"] * 3 + ["full_attention"]
    vc.model_config.hf_text_config = SimpleNamespace(num_hidden_layers=4, layer_types=kinds, sliding_window=512)
    extra = {"overrides": {"tiers": {"storage": [{"kind": "file", "path": str(tmp_path / "pages")}]}}}
    for on in (None, False):
        vc.scheduler_config.disable_hybrid_kv_cache_manager = on
        config = cache_config_for(vc, extra)
        assert config.model.layers.canonical() == "sliding:512*3,full"
        assert config.tiers.storage[0].split_layers is True
    vc.scheduler_config.disable_hybrid_kv_cache_manager = True
    config = cache_config_for(vc, extra)
    assert config.model.layers.canonical() == "sliding:512*3,full"
    assert config.tiers.storage[0].split_layers is False
    vc.model_config.disable_sliding_window = True  # its sliding layers then attend over everything
    assert cache_config_for(vc).model.name.endswith("|sliding-window-disabled")
    vc.model_config.hf_text_config.layer_types = ["linear_attention"] * 3 + ["full_attention"]
    with pytest.raises(UnsupportedModelError, match="linear_attention"):
        cache_config_for(vc)


def test_the_connectors_own_extra_keys_are_checked() -> None:
    opts = connector_options({"metrics_port": 0, "stats_interval_s": 0.5})
    assert (opts.metrics_port, opts.stats_interval_s, opts.metrics_host) == (0, 0.5, "127.0.0.1")
    assert connector_options({}).metrics_port is None
    assert connector_options({}).gil_switch_interval_s == DEFAULT_SWITCH_INTERVAL_S
    assert connector_options({"gil_switch_interval_s": 0.001}).gil_switch_interval_s == 0.001
    assert connector_options({"gil_switch_interval_s": 0}).gil_switch_interval_s is None
    assert connector_options({"gil_switch_interval_s": None}).gil_switch_interval_s is None
    for bad in ({"metrics_port": 70000}, {"metrics_port": "9400"}, {"metrics_port": True},
                {"stats_interval_s": -1}, {"stats_interval_s": float("nan")}, {"metrics_host": ""},
                {"gil_switch_interval_s": -0.001}, {"gil_switch_interval_s": "fast"}, {"gil_switch_interval_s": 2},
                {"gil_switch_interval_s": True}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            connector_options(bad)


def test_the_switch_interval_is_shortened_never_lengthened_and_given_back() -> None:
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        with shortened_switch_interval(0.0005) as ours:
            assert ours == pytest.approx(0.0005) and sys.getswitchinterval() == pytest.approx(0.0005)
            with shortened_switch_interval(0.002) as inner:  # longer than the one in force: left
                assert inner == pytest.approx(0.0005)
            with shortened_switch_interval(None):
                assert sys.getswitchinterval() == pytest.approx(0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.005)  # the cache closed: the old one is back
        with shortened_switch_interval(0.0005):
            sys.setswitchinterval(0.0001)  # someone else changed it meanwhile: theirs is kept
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    finally:
        sys.setswitchinterval(before)


# -- metrics export --------------------------------------------------------------------------------


def test_the_metrics_export_survives_the_trip_through_vllms_processes_with_vllms_labels(tmp_path: Path) -> None:
    """What the worker exports is plain data (JSON round trip) and decodes to the same samples, with
    vLLM's labels added; a malformed family is skipped, never a failed scrape."""
    import json

    config = load_config(overrides={
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "page_size": 4, "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "64KiB"}},
    }, env={})
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(
        CacheService(config, str(tmp_path / "s.sock"))
    ) as service:
        portal.call(service.cache.store, make_tokens(16), make_kv(config, 16))
        service.worker_profile.add("save", 0.25)
        data = json.loads(json.dumps(portal.call(service.export)))
    families = {f.name: f for f in decode([*data, ["broken"]], {"model_name": "m", "engine": "0"})}
    stored = families["hicache_stored_pages"].samples[0]
    assert stored.value == 4 and stored.labels == {"model_name": "m", "engine": "0"}
    hooks = {(s.labels["side"], s.labels["hook"]): s.value for s in families["hicache_vllm_hook_seconds"].samples}
    assert hooks[("worker", "save")] == 0.25
    assert families["hicache_lookup_seconds"].type == "histogram"
    assert encode_families(decode(data)) == data  # nothing lost or reshaped on the way


# -- side channel ----------------------------------------------------------------------------------


def test_the_scheduler_learns_what_the_worker_holds_over_the_channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "run"))
    config = load_config(overrides={
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
        "page_size": 4, "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "64KiB"}},
    }, env={})
    path = socket_path("engine-1")
    assert path == socket_path("engine-1") != socket_path("engine-2")
    tokens = make_tokens(40)
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(CacheService(config, path)) as service:
        client = ChannelClient(path, timeout_s=5)
        assert client.call({"op": "lookup", "req": "a", "tokens": tokens, "prefetch": True}) == {
            "tokens": 0, "by_tier": {"device": 0, "host": 0}, "held": False}  # no prefetch: no forget owed
        portal.call(service.cache.store, tokens[:32], make_kv(config, 32))
        reply = client.call({"op": "lookup", "req": "a", "tokens": tokens, "prefetch": False})
        assert reply is not None and reply["tokens"] == 32
        # The scheduler sends token ids packed (base64 of int64s): the same answer.
        assert client.call({"op": "lookup", "req": "a", "tokens": pack_tokens(tokens), "prefetch": False}) == reply
        assert unpack_tokens(pack_tokens(tokens)) == bytearray(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        # A bad message is answered with an error (a miss for the caller); the service goes on.
        assert client.call({"op": "lookup", "req": "a", "tokens": [-1]}) is None
        assert client.call({"op": "lookup", "req": "a", "tokens": pack_tokens([5, -1])}) is None
        assert client.call({"op": "lookup", "req": "a", "tokens": "not base64!"}) is None
        assert client.call({"op": "lookup", "req": "a", "tokens": "AAAA"}) is None  # 3 bytes: not whole int64s
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(path)
        raw.sendall(encode({"op": "nonsense"})[:3])  # a torn frame, then the peer leaves
        raw.close()
        stats = client.call({"op": "stats"})
        assert stats is not None and stats["connector"]["lookups"] == 3 and stats["open_steps"] == 0
        client.close()
    # The worker is gone: the call fails within its bound and is a miss, never an exception.
    gone = ChannelClient(path, timeout_s=1, connect_timeout_s=0.2)
    assert gone.call({"op": "stats"}) is None and gone.failures == 1
    assert not Path(path).exists()


# -- the channel's folder: another local user may have made its predictable name first ----------------

_CHANNEL_CONFIG = {
    "model": {"name": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float32"},
    "page_size": 4, "tiers": {"device": {"capacity": "64KiB", "device": "cpu"}, "host": {"capacity": "64KiB"}},
}


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A temp dir of the test's own in place of /tmp (a short path: a socket's is at most 107 bytes),
    no runtime dir set, no random folder chosen yet. (``tmp_path`` first: pytest makes it under the real one.)"""
    tmp = Path(tempfile.mkdtemp(prefix="hcv-"))
    tmp.chmod(0o1777)  # as /tmp: anyone may create, only the owner may remove
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    monkeypatch.delenv("HICACHE_VLLM_RUNTIME_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(channel, "_fallback", None, raising=False)  # (raising=False: the test runs on older code too)
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _private_folder_of_mine(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o077


def _plant(kind: str, where: Path, elsewhere: Path) -> None:
    """What another local user could have left at the predictable name."""
    elsewhere.mkdir()
    if kind == "dangling link":
        where.symlink_to(elsewhere / "gone")
    elif kind == "link to another folder":
        where.symlink_to(elsewhere)
    elif kind == "folder open to others":
        where.mkdir()
        where.chmod(0o777)
    else:  # a folder of another user's (needs root to make here)
        where.mkdir(mode=0o700)
        os.chown(where, 65534, 65534)


_PLANTED = ["dangling link", "link to another folder", "folder open to others",
            pytest.param("folder of another user", marks=pytest.mark.skipif(
                os.geteuid() != 0, reason="making a folder of another user needs root"))]


@pytest.mark.parametrize("planted", _PLANTED)
def test_a_planted_channel_folder_is_never_followed_and_the_channel_still_starts(
    temp_dir: Path, tmp_path: Path, planted: str
) -> None:
    predictable = temp_dir / f"hicache-vllm-{os.getuid()}"
    elsewhere = tmp_path / "theirs"
    _plant(planted, predictable, elsewhere)
    before = os.lstat(predictable)
    path = Path(socket_path("engine-1"))
    assert path == Path(socket_path("engine-1"))  # one folder for the process
    assert _private_folder_of_mine(path.parent) and path.parent.parent == temp_dir
    assert path.parent != predictable
    config = load_config(overrides=_CHANNEL_CONFIG, env={})
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(CacheService(config, str(path))):
        assert list(elsewhere.iterdir()) == []  # nothing made where the link points
        assert os.lstat(predictable) == before  # and the planted entry left as it was
        client = ChannelClient(str(path), timeout_s=5)
        assert client.call({"op": "stats"}) is not None
        client.close()


def test_the_scheduler_process_finds_the_worker_that_fell_back_to_a_random_folder(
    temp_dir: Path, tmp_path: Path
) -> None:
    """Scheduler and worker are separate processes: each finds the predictable folder planted, and
    the scheduler still reaches the socket the worker listens on."""
    _plant("dangling link", temp_dir / f"hicache-vllm-{os.getuid()}", tmp_path / "theirs")
    # Another random folder of this user's sorts first: the scheduler's own choice may differ from the worker's.
    (temp_dir / f"hicache-vllm-{os.getuid()}-0000").mkdir(mode=0o700)
    channel._fallback = Path(tempfile.mkdtemp(prefix=f"hicache-vllm-{os.getuid()}-", dir=temp_dir))
    path = socket_path("engine-9")
    config = load_config(overrides=_CHANNEL_CONFIG, env={})
    scheduler = (
        "import sys; from hicache.integrations.vllm.channel import ChannelClient, socket_path\n"
        "reply = ChannelClient(socket_path('engine-9'), timeout_s=5, connect_timeout_s=10).call({'op': 'stats'})\n"
        "sys.exit(0 if reply is not None and 'connector' in reply else 1)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HICACHE_VLLM_RUNTIME_DIR", "XDG_RUNTIME_DIR")}
    with start_blocking_portal() as portal, portal.wrap_async_context_manager(CacheService(config, path)):
        done = subprocess.run([sys.executable, "-c", scheduler], env={**env, "TMPDIR": str(temp_dir)},
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_users_runtime_dir_is_preferred_and_only_when_private(temp_dir: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    xdg = temp_dir / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    assert Path(socket_path("e")).parent == xdg / "hicache-vllm"
    assert _private_folder_of_mine(xdg / "hicache-vllm")
    xdg.chmod(0o755)  # not a runtime dir as the XDG spec makes it: not used
    assert Path(socket_path("e")).parent == temp_dir / f"hicache-vllm-{os.getuid()}"


def test_an_explicit_runtime_dir_that_is_a_link_or_open_to_others_is_refused(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "link"))
    with pytest.raises(PermissionError, match="not a link"):
        socket_path("e")
    (tmp_path / "open").mkdir()
    (tmp_path / "open").chmod(0o777)
    monkeypatch.setenv("HICACHE_VLLM_RUNTIME_DIR", str(tmp_path / "open"))
    with pytest.raises(PermissionError):
        socket_path("e")
