"""Third-party backends: by entry point (group ``hicache.storage``) or by class path in the config.

The entry-point test installs a real (tiny) distribution into a temporary folder on ``sys.path``:
``importlib.metadata`` finds its ``entry_points.txt`` exactly as it would a pip-installed plugin.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hicache import ConfigError, HiCache, load_config
from hicache.tiers.storage import available_backends, resolve_backend
from hicache.tiers.storage.memory import MemoryBackend

from .conftest import make_config, make_kv, make_tokens
from .fakes import SlowStorageBackend
from .helpers import push_to_storage

PLUGIN = '''
from hicache.tiers.storage.memory import MemoryBackend


class CountingBackend(MemoryBackend):
    """A plugin: the in-memory backend that counts its reads."""

    kind = "counting"

    class Settings(MemoryBackend.Settings):
        label: str = "plain"

    async def _get(self, keys, into):
        self.reads = getattr(self, "reads", 0) + len(keys)
        return await super()._get(keys, into)
'''


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    site = tmp_path / "site"
    (site / "hicache_counting").mkdir(parents=True)
    (site / "hicache_counting" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    dist = site / "hicache_counting-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-counting\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[hicache.storage]\ncounting = hicache_counting:CountingBackend\n")
    monkeypatch.syspath_prepend(str(site))
    yield "counting"
    sys.modules.pop("hicache_counting", None)


async def test_entry_point_plugin_serves_as_a_tier(installed_plugin: str) -> None:
    assert installed_plugin in available_backends()
    config = make_config(
        8, 16,
        tiers={"storage": [{"kind": installed_plugin, "label": "x"}]},
        policies={"prefetch": "wait_complete", "prefetch_threshold_tokens": 4},
    )
    tokens = make_tokens(5 * config.page_size)
    kv = make_kv(config, len(tokens))
    async with HiCache.from_config(config) as cache:
        backend = cache.controller.storage[0].backend
        assert type(backend).__name__ == "CountingBackend" and backend.settings.label == "x"
        await cache.store(tokens, kv)
        await push_to_storage(cache)
        async with cache.retrieve(tokens) as view:
            await view.wait_all()
            assert view.tokens == len(tokens) and view.by_tier["counting"] == len(tokens)
            k, _ = view.layer(2)
            assert torch.equal(k, kv[0, 2])
        assert backend.reads == 5


def test_plugin_settings_are_validated(installed_plugin: str) -> None:
    with pytest.raises(ConfigError, match=r"tiers\.storage\[0\]\.lable: unknown setting"):
        load_config(overrides={"tiers": {"storage": [{"kind": installed_plugin, "lable": "x"}]}}, env={})


def test_class_path_kinds_resolve() -> None:
    assert resolve_backend("tests.fakes:SlowStorageBackend") is SlowStorageBackend
    assert resolve_backend("tests.fakes.SlowStorageBackend") is SlowStorageBackend
    assert resolve_backend("memory") is MemoryBackend


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nosuch", "unknown storage backend 'nosuch' (available: memory, file"),
        ("tests.fakes:Nope", "has no attribute 'Nope'"),
        ("tests.nosuchmodule:X", "cannot import 'tests.nosuchmodule'"),
        ("tests.conftest:make_config", "not a hicache StorageBackend subclass"),
    ],
)
def test_bad_kinds_are_config_errors(kind: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={"tiers": {"storage": [{"kind": kind}]}}, env={})
    assert "tiers.storage[0].kind" in str(info.value) and message in str(info.value)


def test_tier_names_must_be_distinct() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.storage\[1\]\.name: tier name 'memory' is taken"):
        load_config(overrides={"tiers": {"storage": [{"kind": "memory"}, {"kind": "memory"}]}}, env={})
    with pytest.raises(ConfigError, match="'host' is taken"):
        load_config(overrides={"tiers": {"storage": [{"kind": "memory", "name": "host"}]}}, env={})
