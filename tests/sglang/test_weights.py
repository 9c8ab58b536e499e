"""Pages are keyed by the weights SGLang serves, not only by the model's name: the revision is the
fingerprint of the local model folder's weight files (as the vLLM connector makes it), so two
models of the same name with other weights never share pages; a model with nothing to fingerprint
is keyed by name alone, and a warning at start says so."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .harness import backend, fill, page_hashes, pools, tokens_for

pytestmark = pytest.mark.usefixtures("sglang_rank")

PAGES = 4


def _model(folder: Path, weights: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(weights)
    return folder


@contextmanager
def _sglang_serves(model_path: Path) -> Iterator[None]:
    """SGLang's runtime context as its scheduler publishes it, for ``--model-path model_path``."""
    from sglang.srt.runtime_context import _CONTEXT

    with _CONTEXT.override_server_args(model_path=str(model_path)):
        yield


def _write(storage: list[dict[str, Any]], model: str) -> tuple[Any, list[str]]:
    """An engine of ``model`` writes PAGES pages and closes: ``(host pool, their keys)``."""
    _, host = pools("page_first")
    ps = host.page_size
    keys = page_hashes(tokens_for(PAGES, ps, seed=41), ps)
    first = backend(host, {"interface_v1": 1, "storage": storage}, model=model)
    try:
        slots = host.alloc(PAGES * ps)
        fill(host, slots, seed=42)
        assert all(first.batch_set_v1(keys, slots))
        assert first.batch_exists(keys) == PAGES
    finally:
        first.close()
    return host, keys


def test_new_weights_in_the_same_folder_do_not_read_the_old_weights_pages(tmp_path: Path) -> None:
    """SGLang's served name defaults to its --model-path: the same name before and after the weights changed."""
    storage = [{"kind": "file", "path": str(tmp_path / "pages")}]
    folder = _model(tmp_path / "model", b"weights, first fine-tune")
    host, keys = _write(storage, str(folder))
    again = backend(host, {"interface_v1": 1, "storage": storage}, model=str(folder))
    try:
        assert again.batch_exists(keys) == PAGES  # the same weights: the same pages
    finally:
        again.close()
    _model(folder, b"weights, second fine-tune")  # replaced in place, same name
    later = backend(host, {"interface_v1": 1, "storage": storage}, model=str(folder))
    try:
        assert later.batch_exists(keys) == 0
        assert later.config is not None and later.config.model.revision.startswith("xxh3-128:")
    finally:
        later.close()


def test_one_served_name_over_two_model_folders_shares_pages_only_for_the_same_weights(tmp_path: Path) -> None:
    storage = [{"kind": "file", "path": str(tmp_path / "pages")}]
    a = _model(tmp_path / "a", b"weights A")
    b = _model(tmp_path / "b", b"weights B")
    same_as_a = _model(tmp_path / "copy-of-a", b"weights A")
    with _sglang_serves(a):
        host, keys = _write(storage, "served-name")
    for folder, shared in ((b, 0), (same_as_a, PAGES)):
        with _sglang_serves(folder):
            other = backend(host, {"interface_v1": 1, "storage": storage}, model="served-name")
        try:
            assert other.batch_exists(keys) == shared, folder.name
        finally:
            other.close()


def test_a_model_with_nothing_to_fingerprint_is_keyed_by_name_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    storage = [{"kind": "file", "path": str(tmp_path / "pages")}]
    _, host = pools("page_first")
    with caplog.at_level(logging.WARNING, logger="hicache.sglang"):
        hub = backend(host, {"interface_v1": 1, "storage": storage}, model="org/model-on-the-hub")
        hub.close()
    assert any("keyed by its name alone" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hicache.sglang"):
        pinned = backend(host, {"interface_v1": 1, "storage": storage, "overrides": {"model": {"revision": "r-2025"}}},
                         model="org/model-on-the-hub")
        assert pinned.config is not None and pinned.config.model.revision == "r-2025"
        pinned.close()
    assert not any("keyed by its name alone" in r.getMessage() for r in caplog.records)
