"""Layer kinds in the config and the namespace: the forms a layout is written in, what is refused,
and which layouts share a namespace (only equal ones; every all-full spelling is the old one)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache import ConfigError, load_config
from hicache.containers import namespace_from_config
from hicache.layer_kinds import STATE, LayerKind, LayerKinds, StateTensor, parse_state


def test_every_spelling_of_a_layer_is_the_same_layer() -> None:
    forms = ["sliding:512", {"kind": "sliding", "window": 512}, LayerKind("sliding", 512)]
    assert {LayerKind.parse(f) for f in forms} == {LayerKind("sliding", 512)}
    assert LayerKind.parse("full") == LayerKind.parse({"kind": "full"}) == LayerKind()


@pytest.mark.parametrize("bad, says", [
    ("sliding", "sliding:<window>"),
    ("sliding:0", "at least 1"),
    ("recurrent", "recurrent:<state>"),
    ("recurrent:conv=64x3", "name=dims/dtype"),
    ("recurrent:conv=64x0/float32", "name=dims/dtype"),
    ("recurrent:conv=64x3/int8", "name=dims/dtype"),
    ({"kind": "full", "state": "s=4/float32"}, "no state"),
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


def test_a_recurrent_layer_names_its_state_and_takes_the_state_layers_its_bytes_need() -> None:
    kind = LayerKind.parse("recurrent:conv0=64x3/float32+rec0=4x16x16/bfloat16")
    assert kind == LayerKind.parse({"kind": "recurrent", "state": "conv0=64x3/float32+rec0=4x16x16/bfloat16"})
    assert parse_state(kind.state) == (StateTensor("conv0", (64, 3), "float32"), StateTensor("rec0", (4, 16, 16), "bfloat16"))
    assert kind.state_bytes == 64 * 3 * 4 + 4 * 16 * 16 * 2 == 2816
    kinds = LayerKinds.parse([kind.text, "full", kind.text])
    assert kinds.recurrent == (0, 2) and kinds.full == (1,) and kinds.hybrid
    assert kinds.canonical() == f"{kind.text},full,{kind.text}"
    # 1,024-byte page slots: 3 state layers each (2,816 bytes); 4,096: one each
    assert kinds.slots(1024) == ((0, 3), (3, 1), (4, 3))
    cache = kinds.cache_layers(1024)
    assert [k.kind for k in cache] == [STATE] * 3 + ["full"] + [STATE] * 3
    assert cache.partial == (0, 1, 2, 4, 5, 6) and cache.splits and cache.window_pages(16) == 1
    assert kinds.cache_layers(4096).partial == (0, 2)


def test_a_recurrent_layout_loads_sizes_its_pages_by_state_layers_and_is_its_own_namespace() -> None:
    base = {"model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8}, "page_size": 4}
    plain = load_config(overrides=base, env={})
    rec = load_config(overrides=base | {"model": base["model"] | {"layers": ["recurrent:s=300/float32", "full"]}}, env={})
    assert rec.slot_bytes == 2 * 4 * 2 * 8 * 4 == 512
    assert rec.num_cache_layers == 4 and rec.page_bytes == 4 * 512  # 1,200 bytes of state: 3 layers
    assert plain.num_cache_layers == 2 and plain.page_bytes == 2 * 512
    other = load_config(overrides=base | {"model": base["model"] | {"layers": ["recurrent:s=301/float32", "full"]}}, env={})
    assert len({namespace_from_config(c).digest for c in (plain, rec, other)}) == 3
    with pytest.raises(ConfigError, match="sliding-window and recurrent"):
        load_config(overrides=base | {"model": base["model"] | {"layers": ["recurrent:s=3/float32", "sliding:8"]}}, env={})
