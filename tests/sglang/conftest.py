"""The SGLang tests run in the SGLang environment (.venv-sglang; `make test` runs them there).

Elsewhere SGLang is not installed and this folder is not collected. Here SGLang's real host pools,
backend factory and ``HiCacheController`` run on CPU in this process (a one-rank gloo group);
``harness.py`` builds them.

SGLang's model configs import ``torchvision.transforms``, and PyPI's torchvision does not load beside
the CPU build of torch, so the environment has none: ``install_torchvision_stub`` puts three empty
modules in its place (only SGLang's vision models would use them, and no test runs one). It is test
code: hicache never imports torchvision, and a real SGLang deployment has its own torchvision.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]


def install_torchvision_stub() -> None:
    """Empty ``torchvision``, ``torchvision.transforms`` and ``.functional`` (with ``InterpolationMode``).

    transformers is asked first whether torchvision is there (it caches the answer, False); in the
    other order it sees the stub, believes torchvision is installed and fails on ``torchvision.io``.
    """
    if "torchvision" in sys.modules:
        return
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    root = types.ModuleType("torchvision")
    transforms = types.ModuleType("torchvision.transforms")
    functional = types.ModuleType("torchvision.transforms.functional")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        NEAREST_EXACT = "nearest-exact"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    functional.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.InterpolationMode = InterpolationMode  # type: ignore[attr-defined]
    transforms.functional = functional  # type: ignore[attr-defined]
    root.transforms = transforms  # type: ignore[attr-defined]
    sys.modules.update(
        {"torchvision": root, "torchvision.transforms": transforms, "torchvision.transforms.functional": functional}
    )


def import_sglang() -> None:
    """Import what the tests use once, its import-time warnings (no CUDA, no AWQ) silenced."""
    install_torchvision_stub()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang.srt.managers.cache_controller  # noqa: F401
        import sglang.srt.mem_cache.memory_pool  # noqa: F401
        import sglang.srt.mem_cache.storage  # noqa: F401


@pytest.fixture(scope="session")
def sglang_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """This process as rank 0 of a one-rank SGLang group (gloo), as the controller expects."""
    import_sglang()
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    store = Path(tmp_path_factory.mktemp("gloo")) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_injected_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's fault injection is on only where a test turns it on."""
    for name in ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"):
        monkeypatch.delenv(name, raising=False)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
