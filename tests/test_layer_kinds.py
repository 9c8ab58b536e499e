"""Layer kinds in the config and the namespace: the forms a layout is written in, what is refused,
and which layouts share a namespace (only equal ones; every all-full spelling is the old one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache import ConfigError, load_config
from hicache.containers import namespace_from_config
from hicache.layer_kinds import LayerKind, LayerKinds


def test_every_spelling_of_a_layer_is_the_same_layer() -> None:
    forms = ["sliding:512", {"kind": "sliding", "window": 512}, LayerKind("sliding", 512)]
    assert {LayerKind.parse(f) for f in forms} == {LayerKind("sliding", 512)}
    assert LayerKind.parse("full") == LayerKind.parse({"kind": "full"}) == LayerKind()


@pytest.mark.parametrize("bad, says", [
    ("sliding", "sliding:<window>"),
    ("sliding:0", "at least 1"),
    ("sliding:x", "sliding:x"),
    ("full:4", "no window"),
    ("mamba", "unknown layer kind"),
    ({"kind": "sliding", "window": True}, "integer"),
    ({"kind": "sliding", "size": 4}, "'size'"),
    (3, "int"),
])
def test_a_bad_layer_is_refused_with_the_reason(bad: object, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LayerKind.parse(bad)


def test_the_canonical_text_runs_length_encodes_and_all_full_is_empty() -> None:
    gemma = LayerKinds.parse((["sliding:512"] * 5 + ["full"]) * 3)
    assert gemma.canonical() == "sliding:512*5,full,sliding:512*5,full,sliding:512*5,full"
    assert gemma.sliding == tuple(i for i in range(18) if i % 6 != 5) and gemma.full == (5, 11, 17)
    assert gemma.window == 512 and gemma.hybrid
    assert LayerKinds.parse(["full"] * 4) == LayerKinds() and not LayerKinds().hybrid
    assert gemma.sliced(5, 7).canonical() == "full,sliding:512"
    assert gemma.sliced(5, 6) == LayerKinds()


def test_a_yaml_layout_loads_and_its_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  num_layers: 3\n  layers: [sliding:128, sliding:128, full]\n")
    config = load_config(path, env={})
    assert config.model.layers.canonical() == "sliding:128*2,full"
    path.write_text("model:\n  num_layers: 2\n  layers: [sliding:128, sliding:128, full]\n")
    with pytest.raises(ConfigError, match="model.layers|num_layers is 2"):
        load_config(path, env={})
    path.write_text("model:\n  num_layers: 2\n  layers: [sliding, full]\n")
    with pytest.raises(ConfigError, match="model.layers"):
        load_config(path, env={})


def test_only_equal_layouts_share_a_namespace_and_all_full_keeps_the_old_one() -> None:
    def digest(layers: list[str]) -> bytes:
        return namespace_from_config(load_config(overrides={"model": {"num_layers": 2, "layers": layers}},
                                                 env={})).digest

    old = namespace_from_config(load_config(overrides={"model": {"num_layers": 2}}, env={})).digest
    assert digest([]) == digest(["full", "full"]) == old
    layouts = [["sliding:64", "full"], ["full", "sliding:64"], ["sliding:32", "full"], ["sliding:64"] * 2]
    assert len({digest(x) for x in layouts} | {old}) == len(layouts) + 1
